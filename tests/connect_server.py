"""A local Spark Connect server in its own process (its own JVM), as a Connect user's cluster would
be: the test process is only a client. Used by tests/test_connect.py; also by hand:

    python tests/connect_server.py [--master local[2]] [--port 15002]

prints the ``sc://`` URL once the server accepts sessions and serves until stdin closes (or Ctrl-C).
A Connect client in the same process as a classic SparkSession cannot start a local server (pyspark
refuses: SESSION_OR_CONTEXT_EXISTS), hence the separate process.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

READY = "hvd_spark connect server at "

_SERVE = """
import os, sys
from pyspark.sql import SparkSession
master, port, local_dir, ready = sys.argv[1:5]
ip = os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
spark = (
    SparkSession.builder.master(master)
    .appName("hvd_spark-connect-server")
    .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
    .config("spark.connect.grpc.binding.address", ip)
    .config("spark.connect.grpc.binding.port", port)
    .config("spark.driver.host", ip)
    .config("spark.driver.bindAddress", ip)
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.sql.shuffle.partitions", "4")
    .config("spark.local.dir", local_dir)
    .config("spark.sql.warehouse.dir", os.path.join(local_dir, "warehouse"))
    .config("spark.python.worker.reuse", "true")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
print(f"{ready}sc://{ip}:{port}", flush=True)
sys.stdin.read()  # serve until the parent closes stdin (or exits)
spark.stop()
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def connect_server(master: str = "local[2]", *, port: int | None = None, local_dir: str, timeout: float = 180):
    """Starts the server, yields its ``sc://`` URL, stops it (and its JVM) on exit."""
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    env.pop("SPARK_REMOTE", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, master, str(port or free_port()), local_dir, READY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    url: list[str] = []

    def read():
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY) and not url:
                url.append(line[len(READY) :].strip())
            lines.append(line)
            del lines[:-200]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while not url:
            if proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if proc.poll() is not None else f"did not start within {timeout:.0f} s"
                raise RuntimeError(f"The Spark Connect server {why}. Its last output:\n{''.join(lines[-40:])}")
            time.sleep(0.2)
        yield url[0]
    finally:
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--port", type=int, default=15002)
    a = p.parse_args()
    import tempfile

    with connect_server(a.master, port=a.port, local_dir=tempfile.mkdtemp(prefix="hvd_spark-connect-")) as url:
        print(f"serving {url}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
