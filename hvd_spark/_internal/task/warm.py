"""Warm ranks: a fork server per host and environment that has already imported TF, Keras and Horovod.

Starting a rank costs a Python start and ``import tensorflow`` (3-5 s of CPU on the project's
machine) before it does anything useful; a hyper-parameter search pays that for every fit. A warm
server pays it once: it imports the heavy modules, then listens on a Unix socket. A task asks it
for a rank; the server forks a child, which takes the job's environment, working directory and
output pipe and runs the same entry point as a fresh rank (``rank/entry.py``). Every fit still runs
in a process of its own (nothing of a previous fit can leak into it: graphs, Keras state, seeds,
Horovod's world), that process just starts with the imports already done. Horovod reads its
settings at ``hvd.init()``, after the fork, so one server serves every job of its environment.

The server is safe to share only with identical processes, so it is keyed by a fingerprint of
everything that could change what an import does: the Python executable, the rank's environment
(minus the variables that differ per job and are read after the fork: ``HOROVOD_*`` and the
launcher's per-job ones), the Spark application and the user. A different environment gets a
server of its own, or a fresh process when warm ranks are off (``HVD_SPARK_WARM=0``).

Lifetime: a server ends when it has had no request for ``HVD_SPARK_WARM_IDLE`` seconds (default
600), and at once when the process it watches (the task's parent: Spark's Python daemon, which
Spark stops with the SparkContext) is gone; its children die with it. A child whose task goes away
(the connection closes) is killed with its process group, as a fresh rank dies with its task.

What a child runs is not the server's choice: every request carries its payload
(``common/forks.py``'s ``Payload``, a ``"module:function"`` the child imports after the fork),
declared by the module that asks for it: the task's for a rank (``task/barrier.py``),
``infer/remote.py``'s for an inference process.

Predictions: a transform's Python UDF worker on the same host may ask the server of its application
for an inference process instead of importing TensorFlow itself (``infer/remote.py``): a child that
loads the model and predicts the columns the worker sends it over a socket pair. Spark's UDF
workers do not share the barrier tasks' environment exactly (another worker pool), so the worker
finds a server through its ``<fp>.json`` (Python, user, application and environment) and takes it
only when the two environments differ in ``forks.INFER_IGNORED`` variables alone.

Files (one folder per user, mode 0700, under the temp dir): ``<fp>.sock`` the socket, ``<fp>.lock``
held by the live server (no second server for one fingerprint), ``<fp>.log`` its output,
``<fp>.json`` what it was started with (for transforms).
"""

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.forks import Payload, ask, connect, held, home, infer_key
from hvd_spark._internal.task import procs

logger = logging.getLogger(__name__)

# What a server imports before it serves (the rank's own imports then cost nothing).
PRELOAD = (
    "numpy",
    "pyarrow",
    "pyarrow.parquet",
    "cloudpickle",
    "tensorflow",
    "keras",
    "horovod.tensorflow",
    "hvd_spark._internal.rank.train",
    "hvd_spark._internal.rank.reader",
    "hvd_spark._internal.rank.optimizer",
    "hvd_spark._internal.rank.state",
    "hvd_spark._internal.rank.batchnorm",
    "hvd_spark._internal.rank.callbacks",
    "hvd_spark._internal.common.serde",
)
PER_JOB = (
    settings.ENV_RANK,
    settings.ENV_HOST,
    settings.ENV_DRIVER_ADDR,
    settings.ENV_JOB_TOKEN,
    settings.ENV_WORKDIR,
    settings.ENV_RANK_STARTED,
)
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 8  # file descriptors a request may carry: the child's output, then its payload's


def idle_seconds(env: dict[str, str]) -> float:
    return settings.WARM_IDLE.get(env=env)


def server_env(env: dict[str, str]) -> dict[str, str]:
    """The part of a rank's environment a server is started with (and keyed by)."""
    return {k: v for k, v in env.items() if not k.startswith("HOROVOD_") and k not in PER_JOB}


def fingerprint(env: dict[str, str], app: str = "") -> str:
    h = hashlib.sha256()
    h.update(json.dumps([sys.executable, os.getuid(), app, PRELOAD, sorted(server_env(env).items())]).encode())
    return h.hexdigest()[:24]


# -- the client side (in a Spark task) -------------------------------------------------------------


class WarmProcess:
    """A rank forked by a warm server, with the part of ``subprocess.Popen``'s interface the task's
    supervision uses (``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``). Its exit code comes
    over the connection; a server that vanishes took the rank with it (reported as SIGKILL)."""

    def __init__(self, conn: socket.socket, pid: int, stdout):
        self.conn = conn
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._buf = b""

    def _read(self, timeout: float) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self.conn], [], [], max(0.0, timeout))
        if not ready:
            return
        try:
            data = self.conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.returncode = self._returncode() if b"\n" in self._buf else -signal.SIGKILL
            self.conn.close()
            return
        self._buf += data
        if b"\n" in self._buf:
            self.returncode = self._returncode()
            self.conn.close()

    def _returncode(self) -> int:
        line = self._buf.split(b"\n", 1)[0]
        try:
            return int(json.loads(line)["rc"])
        except (ValueError, KeyError, TypeError):
            return -signal.SIGKILL

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout or 0)
            self._read(min(left, 1.0))
        return self.returncode


def ensure_server(env: dict[str, str], app: str = "", watch_pid: int | None = None) -> str:
    """Starts the server for this environment unless one lives (or is starting); returns its
    fingerprint. Does not wait for it to be ready."""
    fp = fingerprint(env, app)
    folder = home()
    sock = os.path.join(folder, f"{fp}.sock")
    if os.path.exists(sock) and held(os.path.join(folder, f"{fp}.lock")):
        return fp
    watch = watch_pid if watch_pid is not None else os.getppid()
    with open(os.path.join(folder, f"{fp}.log"), "ab") as log:
        starter = subprocess.Popen(
            [sys.executable, "-m", "hvd_spark._internal.task.warm"]
            + [folder, fp, str(idle_seconds(env)), str(watch), app],
            env=server_env(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=folder,
            start_new_session=True,
        )
    starter.wait(60)  # it forks the server and leaves at once (the server is not this task's child)
    return fp


def spawn(
    payload: Payload, env: dict[str, str], workdir: str, app: str = "", timeout: float = 120.0, args: tuple = ()
) -> WarmProcess | None:
    """A rank forked by the warm server of ``env`` (started if needed, waited for up to ``timeout``
    seconds), running ``payload`` (called with ``args``; the task's is ``rank/entry.py``'s
    ``forked(workdir)``) with ``env`` and ``workdir`` as its working folder. None when no server
    could serve: the caller starts a fresh process. Whether ranks are warm at all is the driver's
    decision (``settings.WARM``: an explicit ``warm=`` wins over ``HVD_SPARK_WARM``), made before
    the task calls this."""
    try:
        fp = ensure_server(env, app)
        folder = home()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        logger.warning("warm ranks unavailable (%s); starting a fresh process", exc)
        return None
    sock_path, lock_path = os.path.join(folder, f"{fp}.sock"), os.path.join(folder, f"{fp}.lock")
    deadline = time.monotonic() + timeout
    conn = None
    while conn is None:
        conn = connect(sock_path)
        if conn is not None:
            break
        if not held(lock_path) or time.monotonic() > deadline:
            logger.warning("the warm server %s did not start (see %s.log); starting a fresh process", fp, fp)
            return None
        time.sleep(0.05)
    read_end, write_end = os.pipe()
    try:
        pid, rest = ask(conn, payload, env=env, workdir=workdir, out_fd=write_end, args=args)
    except (OSError, ValueError, KeyError) as exc:
        conn.close()
        os.close(read_end)
        logger.warning("the warm server %s could not start a rank (%s); starting a fresh process", fp, exc)
        return None
    finally:
        os.close(write_end)
    proc = WarmProcess(conn, pid, os.fdopen(read_end, "rb"))
    proc._buf = rest
    if b"\n" in rest:
        proc.returncode = proc._returncode()
    return proc


# -- the server ----------------------------------------------------------------------------------


def _alive(pid: int, started: float) -> bool:
    import psutil

    try:
        return psutil.Process(pid).create_time() == started
    except psutil.Error:
        return False


class _Server:
    def __init__(self, folder: str, fp: str, idle: float, watch_pid: int, app: str = "", env=None):
        import psutil

        self.folder, self.fp, self.idle, self.app = folder, fp, idle, app
        self.env = dict(os.environ if env is None else env)  # as started: before its imports changed it
        self.watch_pid = watch_pid
        try:
            self.watch_started = psutil.Process(watch_pid).create_time()
        except psutil.Error:
            self.watch_started = -1.0
        self.conns: dict[socket.socket, int] = {}  # connection -> its child's pid
        self.kill_at: dict[int, float] = {}  # child pid -> when to SIGKILL it (its task went away)
        self.last_busy = time.monotonic()

    def serve(self) -> None:
        path = os.path.join(self.folder, f"{self.fp}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead server's socket: this process holds the lock now
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(64)
        self.listener = listener
        try:
            self._describe()
        except OSError as exc:  # transforms cannot find this server; its ranks are served all the same
            print(f"cannot describe this server for transforms: {exc}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: self._stop(listener, path, "SIGTERM"))
        # A child's exit wakes the loop at once (its task is waiting for the exit code).
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self._wake = (wake_r, wake_w)
        print(f"{time.strftime('%H:%M:%S')} warm server {self.fp} ready (pid {os.getpid()})", flush=True)
        while True:
            waiting: list[Any] = [listener, wake_r, *self.conns]
            ready, _, _ = select.select(waiting, [], [], 0.5)
            for s in ready:
                if isinstance(s, int):
                    os.read(wake_r, 512)
                elif s is listener:
                    self._accept(listener)
                else:
                    self._client_gone(s)
            self._reap()
            now = time.monotonic()
            if self.conns:
                self.last_busy = now
            elif now - self.last_busy > self.idle:
                self._stop(listener, path, f"idle for {self.idle:.0f} s")
            if self.watch_started >= 0 and not _alive(self.watch_pid, self.watch_started):
                self._stop(listener, path, f"process {self.watch_pid} (its Spark worker daemon) is gone")

    def _describe(self) -> None:
        """``<fp>.json``: what a transform's UDF worker compares its own with (``forks.find_server``)."""
        info = {"python": sys.executable, "app": self.app, "pid": os.getpid(), "env_key": infer_key(self.env)}
        path = os.path.join(self.folder, f"{self.fp}.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)

    def _stop(self, listener: socket.socket, path: str, why: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} warm server {self.fp} stops: {why}", flush=True)
        for stale in (path, os.path.join(self.folder, f"{self.fp}.json")):
            with contextlib.suppress(OSError):
                os.unlink(stale)
        listener.close()
        for pid in self.conns.values():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        os._exit(0)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.settimeout(10)
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, _MAX_FDS)
            while not msg.endswith(b"\n"):
                more = conn.recv(_MAX_MESSAGE)
                if not more:
                    raise ConnectionError("short request")
                msg += more
            request = json.loads(msg)
            payload = Payload(**request["payload"])
            if len(fds) != 1 + payload.fds:  # the output, then the payload's (an inference child's socket)
                raise ValueError(f"a {payload.name} request carries {1 + payload.fds} file descriptor(s)")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"bad request: {exc}", flush=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, request, payload)  # never returns
        for fd in fds:
            os.close(fd)
        self.conns[conn] = pid
        self.last_busy = time.monotonic()
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            self._client_gone(conn)

    def _child(self, conn: socket.socket, fds: list[int], request: dict, payload: Payload) -> None:
        code = 1
        out_fd = fds[0]
        try:
            for s in (conn, self.listener, *self.conns):
                s.close()
            signal.set_wakeup_fd(-1)
            for fd in self._wake:
                os.close(fd)
            os.setsid()
            procs.die_with_parent()  # the server's end (it is killed, or its Spark worker is gone) ends its ranks
            procs.set_name(payload.process_name)  # ps and /proc/<pid>/comm tell it from the server
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.close(out_fd)
            os.close(devnull)
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["workdir"])
            _reseed()
            sys.path[:] = request.get("sys_path") or sys.path  # an inference child's: the UDF worker's (py-files)
            code = _resolve(payload.target)(*request.get("args", ()), *fds[1:])
        finally:
            os._exit(code if isinstance(code, int) else 0)  # a payload that returns None ended well

    def _client_gone(self, conn: socket.socket) -> None:
        """The task went away (or wrote, which it never does): its rank goes too."""
        pid = self.conns.pop(conn, None)
        conn.close()
        if pid is not None and pid not in self.kill_at:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGTERM)
            self.kill_at[pid] = time.monotonic() + 5.0

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rc = os.waitstatus_to_exitcode(status)
            self.kill_at.pop(pid, None)
            for conn, p in list(self.conns.items()):
                if p == pid:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
                    conn.close()
                    del self.conns[conn]
        now = time.monotonic()
        for pid, when in list(self.kill_at.items()):
            if now >= when:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                self.kill_at[pid] = now + 5.0


def _resolve(target: str):
    """The function a payload's ``"module:function"`` names, imported in the forked child."""
    import importlib

    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _reseed() -> None:
    """A forked rank would share the server's NumPy random state with its siblings; a fresh process
    draws its own. (Python's ``random`` reseeds itself after a fork.)"""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(os.urandom(4), "little"))


def _main(folder: str, fp: str, idle: float, watch_pid: int, app: str = "") -> None:
    lock = os.open(os.path.join(folder, f"{fp}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os._exit(0)  # another server of this fingerprint lives or is starting
    if os.fork() > 0:
        os._exit(0)  # the starter leaves; the server (holding the lock) is nobody's child
    os.setsid()
    procs.load_prctl()  # resolved before any fork: a forked rank only calls it (no library loading)
    started = time.monotonic()
    launch_env = dict(os.environ)  # the imports below may set variables (TF, Keras): not part of the key
    import importlib
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in PRELOAD:
        importlib.import_module(name)
    # The imports' objects (millions, TensorFlow's) leave the collector's generations for good: a
    # forked rank's full collections then skip them (they cost 0.4-0.6 s in the middle of a short
    # fit otherwise) and do not write to the pages it shares with this server.
    gc.collect()
    gc.freeze()
    print(f"{time.strftime('%H:%M:%S')} warm server {fp}: imports took {time.monotonic() - started:.1f} s", flush=True)
    _Server(folder, fp, idle, watch_pid, app, launch_env).serve()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
