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
(minus the variables that differ per job and are read after the fork: ``HOROVOD_*``, torch.distributed's
and the launcher's per-job ones), the Spark application and the user. A different environment gets a
server of its own, or a fresh process when warm ranks are off (``HVD_SPARK_WARM=0``).

Lifetime: a server ends when it has had no request for ``HVD_SPARK_WARM_IDLE`` seconds (default
600), and at once when the process it watches (the task's parent: Spark's Python daemon, which
Spark stops with the SparkContext) is gone; its children die with it. It watches that process from
its first instant, while it imports (a thread until the imports are done, the serving loop after):
the task that starts it passes the process's start time, so a server whose application stopped
before it began ends at once. Its imports have a deadline (``HVD_SPARK_WARM_START_TIMEOUT``), and a
task waits as long for it before it starts its rank cold. A child whose task goes away (the
connection closes) is killed with its process group, as a fresh rank dies with its task; a task
whose server ends while its rank runs is told why (or learns it was killed), and its rank's error
names the server.

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
``<fp>.json`` what it was started with (for transforms). A server removes them when it stops (a
server whose imports failed keeps its log, for the task's warning), and a starting server removes
those of dead servers (``forks.sweep_stale``).
"""

import contextlib
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
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.forks import (
    Payload,
    ask,
    connect,
    create_time,
    held,
    home,
    infer_key,
    log_tail,
    peer_pid,
    remove_server_files,
    sweep_stale,
    take_lock,
)
from hvd_spark._internal.common.topology import TORCH_ENV
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
    *TORCH_ENV,  # torch.distributed's (topology.torch_env): read after the fork, by torch
)
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 8  # file descriptors a request may carry: the child's output, then its payload's


def idle_seconds(env: dict[str, str]) -> float:
    return settings.WARM_IDLE.get(env=env)


def start_seconds(env: dict[str, str]) -> float:
    """How long a server may take to import (``HVD_SPARK_WARM_START_TIMEOUT``), and a task wait for it."""
    return settings.WARM_START_TIMEOUT.get(env=env)


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
    over the connection; a server that vanishes took the rank with it (reported as SIGKILL), and
    :attr:`server_end` then says how the server ended."""

    def __init__(self, conn: socket.socket, pid: int, stdout, fp: str = "", server_pid: int | None = None):
        self.conn = conn
        self.pid = pid
        self.stdout = stdout
        self.fp = fp
        self.server_pid = server_pid
        self.returncode: int | None = None
        self.server_end: str | None = None  # how the server ended while the rank ran ("was killed", "stopped (...)")
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
            if b"\n" in self._buf:
                self.returncode = self._returncode()
            else:  # the server went away without a word: killed (a stop says why)
                self.returncode, self.server_end = -signal.SIGKILL, "was killed"
            self.conn.close()
            return
        self._buf += data
        if b"\n" in self._buf:
            self.returncode = self._returncode()
            self.conn.close()

    def _returncode(self) -> int:
        line = self._buf.split(b"\n", 1)[0]
        try:
            reply = json.loads(line)
            if reply.get("server"):
                self.server_end = f"stopped ({reply['server']})"
            return int(reply["rc"])
        except (ValueError, KeyError, TypeError, AttributeError):
            self.server_end = "sent no exit code"
            return -signal.SIGKILL

    def server_cause(self) -> str:
        """What ended the rank when its server ended first ("" otherwise), for the rank's error."""
        if self.server_end is None:
            return ""
        pid = f" (pid {self.server_pid})" if self.server_pid else ""
        return (
            f"the warm server {self.fp}{pid} that forked this rank {self.server_end}, and its ranks with it "
            f"(its log, while it lives: {os.path.join(home(), self.fp + '.log')})"
        )

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
    fingerprint. Does not wait for it to be ready. The server watches ``watch_pid`` (default: this
    process's parent, Spark's Python daemon) from its first instant.

    Raises:
        ProcessLookupError: the process to watch is already gone (its application stopped).
    """
    fp = fingerprint(env, app)
    folder = home()
    if held(os.path.join(folder, f"{fp}.lock")):  # it lives, or is starting (it holds its lock from the start)
        return fp
    watch = watch_pid if watch_pid is not None else os.getppid()
    watch_started = create_time(watch)
    if watch_started is None:
        raise ProcessLookupError(f"process {watch}, which a warm server would serve, is gone")
    log_path = os.path.join(folder, f"{fp}.log")
    with open(log_path, "ab") as log:
        os.utime(log_path)  # just changed: forks.sweep_stale leaves a starting server's files alone
        starter = subprocess.Popen(
            [sys.executable, "-m", "hvd_spark._internal.task.warm"]
            + [folder, fp, str(idle_seconds(env)), str(watch), repr(watch_started), str(start_seconds(env)), app],
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
    payload: Payload,
    env: dict[str, str],
    workdir: str,
    app: str = "",
    timeout: float = 120.0,
    args: tuple = (),
    say: Callable[[str], None] | None = None,
) -> WarmProcess | None:
    """A rank forked by the warm server of ``env`` (started if needed, waited for up to ``timeout``
    seconds and at most ``HVD_SPARK_WARM_START_TIMEOUT``), running ``payload`` (called with
    ``args``; the task's is ``rank/entry.py``'s ``forked(workdir)``) with ``env`` and ``workdir`` as
    its working folder. None when no server could serve: the caller starts a fresh process, and
    ``say`` (the driver's warning) was told why. Whether ranks are warm at all is the driver's
    decision (``settings.WARM``: an explicit ``warm=`` wins over ``HVD_SPARK_WARM``), made before
    the task calls this."""

    def cold(why: str) -> None:
        logger.warning("%s; starting a fresh process", why)
        if say is not None:
            say(f"hvd_spark: {why}; this rank starts cold (a fresh process)")

    try:
        fp = ensure_server(env, app)
        folder = home()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        cold(f"warm ranks unavailable ({exc})")
        return None
    sock_path, lock_path = os.path.join(folder, f"{fp}.sock"), os.path.join(folder, f"{fp}.lock")
    bound = min(timeout, start_seconds(env))
    began = time.monotonic()
    conn = None
    while conn is None:
        conn = connect(sock_path)
        if conn is not None:
            break
        waited = time.monotonic() - began
        if not held(lock_path):
            cold(f"warm server {fp} ended before it was ready ({log_tail(folder, fp) or 'no log'})")
            return None
        if waited > bound:
            cold(
                f"warm server {fp} not ready after {waited:.0f} s (HVD_SPARK_WARM_START_TIMEOUT={start_seconds(env):g} "
                f"s; its log {os.path.join(folder, fp + '.log')}: {log_tail(folder, fp) or 'empty'})"
            )
            return None
        time.sleep(0.05)
    read_end, write_end = os.pipe()
    try:
        pid, rest = ask(conn, payload, env=env, workdir=workdir, out_fd=write_end, args=args)
    except (OSError, ValueError, KeyError) as exc:
        conn.close()
        os.close(read_end)
        cold(f"warm server {fp} could not start a rank ({exc})")
        return None
    finally:
        os.close(write_end)
    proc = WarmProcess(conn, pid, os.fdopen(read_end, "rb"), fp, peer_pid(conn))
    proc._buf = rest
    if b"\n" in rest:
        proc.returncode = proc._returncode()
    return proc


# -- the server ----------------------------------------------------------------------------------


def _alive(pid: int, started: float) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (not another given its pid)."""
    return create_time(pid) == started


def _quit(folder: str, fp: str, why: str, code: int = 0, keep_log: bool = False) -> None:
    """Ends a server that is not serving yet: says why in its log, removes its files (its log too,
    unless ``keep_log``: a failed start's log is what the waiting task quotes) and exits."""
    print(f"{time.strftime('%H:%M:%S')} warm server {fp} stops: {why}", flush=True)
    remove_server_files(folder, fp, log=not keep_log)
    os._exit(code)


class _StartGuard:
    """While a server imports (seconds, or forever when an import hangs), a thread of its own ends it
    when the process it serves is gone or the imports are past their deadline. Checked once in the
    caller's thread first: a server whose application is already gone never imports anything."""

    def __init__(self, folder: str, fp: str, watch_pid: int, watch_started: float, deadline: float):
        self.folder, self.fp, self.watch_pid, self.watch_started = folder, fp, watch_pid, watch_started
        self.limit, self.deadline = deadline, time.monotonic() + deadline
        self._done = threading.Event()
        self.check()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-warm-guard")
        self._thread.start()

    def check(self) -> None:
        if not _alive(self.watch_pid, self.watch_started):
            _quit(self.folder, self.fp, f"process {self.watch_pid} (its Spark worker daemon) is gone")
        if time.monotonic() > self.deadline:
            why = f"its imports took more than {self.limit:g} s (HVD_SPARK_WARM_START_TIMEOUT)"
            _quit(self.folder, self.fp, why, code=1, keep_log=True)

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self.check()

    def stop(self) -> None:
        """Ends the thread (a server forks its ranks single-threaded); the serving loop watches from here on."""
        self._done.set()
        self._thread.join()


class _Server:
    def __init__(
        self, folder: str, fp: str, idle: float, watch_pid: int, watch_started: float, app: str = "", env=None
    ):
        self.folder, self.fp, self.idle, self.app = folder, fp, idle, app
        self.env = dict(os.environ if env is None else env)  # as started: before its imports changed it
        self.watch_pid, self.watch_started = watch_pid, watch_started
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
            if not _alive(self.watch_pid, self.watch_started):
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
        """Ends the server: its files removed (the lock last), its children killed, and their tasks
        told why (their ranks' errors name this server)."""
        print(f"{time.strftime('%H:%M:%S')} warm server {self.fp} stops: {why}", flush=True)
        remove_server_files(self.folder, self.fp)
        listener.close()
        for conn, pid in self.conns.items():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"rc": -signal.SIGKILL, "server": why}).encode() + b"\n")
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


def _main(
    folder: str, fp: str, idle: float, watch_pid: int, watch_started: float, deadline: float, app: str = ""
) -> None:
    lock = take_lock(os.path.join(folder, f"{fp}.lock"))  # held (open) while the server lives
    if lock is None:
        os._exit(0)  # another server of this fingerprint lives or is starting
    if os.fork() > 0:
        os._exit(0)  # the starter leaves; the server (holding the lock) is nobody's child
    os.setsid()
    procs.load_prctl()  # resolved before any fork: a forked rank only calls it (no library loading)
    started = time.monotonic()
    print(f"{time.strftime('%H:%M:%S')} warm server {fp} starts (pid {os.getpid()}, serving {watch_pid})", flush=True)
    guard = _StartGuard(folder, fp, watch_pid, watch_started, deadline)  # ends it at once if that is gone
    swept = sweep_stale(folder, keep=fp)
    if swept:
        print(f"removed the files of {len(swept)} dead warm server(s)", flush=True)
    launch_env = dict(os.environ)  # the imports below may set variables (TF, Keras): not part of the key
    import importlib
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - the task waiting for it starts its rank cold, quoting this
        traceback.print_exc()
        _quit(folder, fp, f"importing {name} failed: {type(exc).__name__}: {exc}", code=1, keep_log=True)
    guard.stop()
    # The imports' objects (millions, TensorFlow's) leave the collector's generations for good: a
    # forked rank's full collections then skip them (they cost 0.4-0.6 s in the middle of a short
    # fit otherwise) and do not write to the pages it shares with this server.
    gc.collect()
    gc.freeze()
    print(f"{time.strftime('%H:%M:%S')} warm server {fp}: imports took {time.monotonic() - started:.1f} s", flush=True)
    _Server(folder, fp, idle, watch_pid, watch_started, app, launch_env).serve()


if __name__ == "__main__":
    _main(
        sys.argv[1],
        sys.argv[2],
        float(sys.argv[3]),
        int(sys.argv[4]),
        float(sys.argv[5]),
        float(sys.argv[6]),
        sys.argv[7] if len(sys.argv) > 7 else "",
    )
