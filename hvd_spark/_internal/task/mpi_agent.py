"""mpirun across hosts without ssh: Open MPI's rsh agent, served by the job's own Spark tasks.

``mpirun`` (on rank 0's task) starts one ``orted`` daemon per other host by running its "rsh agent"
as ``AGENT HOST COMMAND...``. hvd_spark's agent is ``python -m hvd_spark._internal.task.mpi_agent``: it
looks ``HOST`` up in ``HVD_SPARK_MPI_HOSTS`` (JSON ``{host: "addr:port"}``, set by rank 0's task) and
asks the :class:`CommandServer` that the first barrier task on that host runs to execute
``COMMAND`` with ``/bin/sh -c``. The server streams the command's output back and ends with its exit
code, which the agent exits with; so to mpirun the agent behaves like ``ssh HOST COMMAND``.

The protocol is JSON lines (``common/service.py``'s ``send_line``): the agent sends
``{"token", "command"}``; the server answers ``{"out": line}`` per output line and finally
``{"exit": code}``. Connections without the job's token are dropped. The command runs in its own
process group and is killed when the agent's connection drops (mpirun died) or the task stops it
(the job was aborted), so no ``orted`` outlives its job.
"""

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.service import read_lines, send_line
from hvd_spark._internal.task.procs import kill_tree, popen_args

ENV_HOSTS = settings.ENV_MPI_HOSTS  # {host: "addr:port"} of every host's command server


def agent_command() -> str:
    """The value of Open MPI's ``plm_rsh_agent`` that runs this module's agent."""
    if " " in sys.executable:
        raise RuntimeError(
            "backend='mpi' across hosts runs its rsh agent with this Python, and Open MPI splits the agent "
            f"on spaces: move the Python installation to a path without spaces. Received: {sys.executable!r}."
        )
    return f"{sys.executable} -m hvd_spark._internal.task.mpi_agent"


class CommandServer:
    """Runs the commands that rank 0's mpirun sends through the agent (the ``orted`` of this host)."""

    def __init__(self, bind_ip: str, token: str, env: dict[str, str], cwd: str):
        self.token = token
        self.env = env
        self.cwd = cwd
        self.sock = socket.create_server((bind_ip, 0))
        self.addr = f"{bind_ip}:{self.sock.getsockname()[1]}"
        self.started = threading.Event()  # a command was started
        self.finished = threading.Event()  # ... and has ended
        self.returncode: int | None = None
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="hvd_spark-mpi-commands").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="hvd_spark-mpi-command").start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(settings.MPI_CONNECT_TIMEOUT.get())
        lines = read_lines(conn)
        try:
            hello = next(lines)
        except (StopIteration, OSError):
            conn.close()
            return
        if not isinstance(hello, dict) or not secrets.compare_digest(str(hello.get("token", "")), self.token):
            conn.close()
            return
        conn.settimeout(None)
        with self._lock:
            if self._stopped:
                conn.close()
                return
            proc = subprocess.Popen(
                **popen_args(["/bin/sh", "-c", str(hello.get("command", ""))]),  # no preexec_fn: see procs.py
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self._procs.append(proc)
        self.started.set()
        # The agent closing its end means mpirun is gone: stop the command with it.
        watcher = threading.Thread(target=self._kill_on_hangup, args=(conn, proc), daemon=True)
        watcher.start()
        try:
            for raw in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
                send_line(conn, {"out": raw.decode(errors="replace").rstrip("\n")})
        except OSError:
            kill_tree(proc, 1.0)
        rc = proc.wait()
        self.returncode = rc
        self.finished.set()
        with contextlib.suppress(OSError):
            send_line(conn, {"exit": rc})
            conn.shutdown(socket.SHUT_WR)
        conn.close()

    def _kill_on_hangup(self, conn: socket.socket, proc: subprocess.Popen) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(1024):
                pass
        kill_tree(proc, 2.0)

    def stop(self, grace: float = 2.0) -> None:
        """Stops accepting and kills every command still running (with its process group)."""
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        with contextlib.suppress(OSError):
            self.sock.close()
        for proc in procs:
            kill_tree(proc, grace)


def run_remote(host: str, command: str, hosts: dict[str, str], token: str, out=None) -> int:
    """What the agent does: runs ``command`` on ``host`` through its command server; returns its exit code."""
    out = out or sys.stderr
    addr = hosts.get(host)
    if addr is None:
        print(
            f"hvd_spark mpi agent: mpirun asked for host {host!r}, which runs no task of this job "
            f"(hosts: {sorted(hosts)}).",
            file=out,
            flush=True,
        )
        return 255
    ip, port = addr.rsplit(":", 1)
    try:
        sock = socket.create_connection((ip, int(port)), timeout=settings.MPI_CONNECT_TIMEOUT.get())
    except OSError as e:
        print(f"hvd_spark mpi agent: cannot reach the task on host {host} at {addr}: {e}", file=out, flush=True)
        return 255
    sock.settimeout(None)

    # mpirun ends its agents with SIGTERM: close the connection so the host stops the command.
    def _hang_up(*_) -> None:
        sock.close()
        os._exit(143)

    signal.signal(signal.SIGTERM, _hang_up)
    send_line(sock, {"token": token, "command": command})
    try:
        for msg in read_lines(sock):
            if "out" in msg:
                print(msg["out"], file=out, flush=True)
            elif "exit" in msg:
                return int(msg["exit"])
    except OSError:
        pass
    print(f"hvd_spark mpi agent: the task on host {host} closed the connection before the command ended.", file=out)
    return 255


def main(argv: list[str]) -> int:
    # Open MPI calls: AGENT [agent args] HOST COMMAND... (the command is meant for a remote shell).
    if len(argv) < 2:
        print("usage: python -m hvd_spark._internal.task.mpi_agent HOST COMMAND...", file=sys.stderr)
        return 2
    hosts = json.loads(os.environ.get(ENV_HOSTS) or "{}")
    token = os.environ.get(settings.ENV_JOB_TOKEN, "")
    return run_remote(argv[0], " ".join(argv[1:]), hosts, token)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
