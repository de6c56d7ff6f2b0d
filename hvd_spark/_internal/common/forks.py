"""A host's warm servers (``task/warm.py``) as the processes that ask them for a child see them:
their folder, the request for a forked child and what it runs, and which server a transform's UDF
worker may use.

Two kinds of processes ask: a Spark barrier task for its rank (``task/barrier.py``), and a
transform's Python UDF worker for an inference process (``infer/remote.py``); the server itself
reads the same records. So this lives in ``common/``: a UDF worker loads nothing of ``task/``.

What a child runs is a :class:`Payload`, declared by the module that asks for it and sent with the
request; the server imports its target in the forked child and knows no payload of its own.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Sequence

from hvd_spark._internal.common import settings

PROCESS_PREFIX = "hvd_spark-"  # a forked child's process name: this, then its payload's name

# Variables in which a UDF worker's environment may differ from a server's and still be served by it:
# set by Spark per worker pool, read only after the fork (thread counts, unbuffered output), or only
# changing how much TensorFlow logs (the ranks' quiet default).
INFER_IGNORED = frozenset(
    {
        "PYTHON_WORKER_FACTORY_SECRET",
        "SPARK_SIMPLIFIED_TRACEBACK",
        "PYTHONUNBUFFERED",
        "TF_CPP_MIN_LOG_LEVEL",
        "OMP_NUM_THREADS",
        "TF_NUM_INTRAOP_THREADS",
        "TF_NUM_INTEROP_THREADS",
        settings.ENV_NUM_THREADS,
    }
)


@dataclasses.dataclass(frozen=True)
class Payload:
    """What a child forked by a warm server runs: ``target`` (``"module:function"``, imported in the
    child with importlib) called with the request's arguments, then the file descriptors the request
    carries besides the child's output (``fds`` of them); its return value is the child's exit code.

    Example: ``Payload("infer", "hvd_spark._internal.infer.child:serve", fds=1)`` (a socket to
    talk over)."""

    name: str  # the child's process name is PROCESS_PREFIX + name (ps, /proc/<pid>/comm: 15 bytes)
    target: str
    fds: int = 0

    def __post_init__(self):
        module, _, function = self.target.partition(":")
        if not module or not function.isidentifier():
            raise ValueError(f"A payload's target is 'module:function'. Received: target={self.target!r}.")
        if len(self.process_name.encode()) > 15:
            raise ValueError(f"A payload's process name has at most 15 bytes. Received: name={self.name!r}.")

    @property
    def process_name(self) -> str:
        return PROCESS_PREFIX + self.name


def home() -> str:
    """This user's folder for servers' sockets, locks and logs, created private; refused when it is
    not this user's or others can write to it (a socket there could be someone else's server)."""
    path = os.path.join(tempfile.gettempdir(), f"hvd_spark-warm-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(path) or os.path.islink(path):
        raise PermissionError(f"{path} is not a private folder of this user: warm ranks are off")
    return path


SERVER_FILES = (".sock", ".json", ".json.tmp", ".log", ".lock")  # a server's files: <fingerprint><suffix>
STALE_AFTER = 60.0  # seconds without a change before the files of a server that holds no lock are stale


def server_files(folder: str, fp: str, *, log: bool = True) -> list[str]:
    """The paths of the server ``fp``'s files in ``folder``, its lock last (and its log unless ``log=False``)."""
    return [os.path.join(folder, fp + s) for s in SERVER_FILES if log or s != ".log"]


def remove_server_files(folder: str, fp: str, *, log: bool = True) -> None:
    """Removes the files of the server ``fp`` (the caller holds its lock, or no server does): the lock
    last, so that a server starting meanwhile takes a fresh one (``warm.py``'s ``_take_lock``)."""
    for path in server_files(folder, fp, log=log):
        with contextlib.suppress(OSError):
            os.unlink(path)


def sweep_stale(folder: str, keep: str = "", stale_after: float = STALE_AFTER) -> list[str]:
    """Removes the files of dead servers from ``folder``: every fingerprint but ``keep`` whose lock no
    live server holds and whose files have not changed for ``stale_after`` seconds (a server being
    started has just touched its log). Returns the fingerprints removed. A new server calls this."""
    groups: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            suffix = next((s for s in SERVER_FILES if name.endswith(s)), None)
            if suffix is not None and name != suffix:
                groups.setdefault(name[: -len(suffix)], []).append(os.path.join(folder, name))
    removed = []
    now = time.time()
    for fp, paths in sorted(groups.items()):
        if fp == keep:
            continue
        try:
            if now - max(os.lstat(p).st_mtime for p in paths) < stale_after:
                continue
        except OSError:
            continue  # changed meanwhile: a server is starting or stopping
        lock = os.path.join(folder, f"{fp}.lock")
        fd = None
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(lock, os.O_RDONLY)
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live server's
            remove_server_files(folder, fp)  # under its lock: no server of fp starts meanwhile
            removed.append(fp)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def take_lock(path: str, tries: float = 1.0) -> int | None:
    """An exclusive lock on ``path`` (a server's, held while it lives), or None when another server of
    the fingerprint holds it. Retried for ``tries`` seconds: ``forks.sweep_stale`` holds a dead
    server's lock a moment while it removes its files, and the file must still be ``path``'s after."""
    give_up = time.monotonic() + tries
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > give_up:
                return None
            time.sleep(0.05)
            continue
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed (or replaced) before the lock was taken: take the path's own


def log_tail(folder: str, fp: str) -> str:
    """The last line of the server ``fp``'s log ("" when there is none)."""
    try:
        with open(os.path.join(folder, f"{fp}.log"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 2048))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def peer_pid(conn: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (Linux), or None."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except (OSError, AttributeError):
        return None


def create_time(pid: int) -> float | None:
    """When process ``pid`` started (what tells it from a later process given the same pid), or None
    when it is gone: on Linux its start in clock ticks after boot (``/proc/<pid>/stat``), which a step
    of the system clock (NTP, a resumed VM) does not move, unlike a wall-clock start time; elsewhere
    psutil's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()  # after the command's name, which may hold spaces
        return float(fields[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


def held(lock_path: str) -> bool:
    """Whether a live server holds ``lock_path`` (it keeps an exclusive lock while it lives)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def ask(
    conn: socket.socket,
    payload: Payload,
    *,
    env: dict[str, str],
    workdir: str,
    out_fd: int,
    fds: Sequence[int] = (),
    args: Sequence = (),
    sys_path: list[str] | None = None,
) -> tuple[int, bytes]:
    """Asks the server at the other end of ``conn`` for a child running ``payload`` with ``env``,
    in ``workdir``, writing its output to ``out_fd``, called with ``args`` (JSON values) and ``fds``
    (``payload.fds`` of them); ``sys_path`` replaces the child's ``sys.path`` before it imports the
    target. Returns the forked child's pid and what followed the reply."""
    if len(fds) != payload.fds:
        raise ValueError(f"The payload {payload.name!r} takes {payload.fds} file descriptor(s). Received: {len(fds)}.")
    request = {"payload": dataclasses.asdict(payload), "args": list(args), "env": env, "workdir": workdir}
    if sys_path is not None:
        request["sys_path"] = sys_path
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out_fd, *fds])
    conn.settimeout(30)
    reply = b""
    while b"\n" not in reply:
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the warm server closed the connection before forking")
        reply += chunk
    conn.settimeout(None)
    line, rest = reply.split(b"\n", 1)
    return int(json.loads(line)["pid"]), rest


def infer_key(env: dict[str, str]) -> str:
    """A digest of ``env`` without :data:`INFER_IGNORED` (the ``.json`` holds no values: they may be secrets)."""
    kept = sorted((k, v) for k, v in env.items() if k not in INFER_IGNORED)
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def find_server(env: dict[str, str], app: str) -> str | None:
    """The fingerprint of a live server of this user, Python and application whose environment
    differs from ``env`` only in :data:`INFER_IGNORED` (a transform's UDF worker may use it), or None."""
    try:
        folder = home()
        names = sorted(os.listdir(folder))
    except (OSError, PermissionError):
        return None
    mine = infer_key(env)
    for name in names:
        if not name.endswith(".json"):
            continue
        fp = name[: -len(".json")]
        try:
            with open(os.path.join(folder, name)) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue  # being written, or a dead server's
        if not isinstance(info, dict) or info.get("python") != sys.executable or info.get("app") != app:
            continue
        if info.get("env_key") == mine and held(os.path.join(folder, f"{fp}.lock")):
            return fp
    return None


def fork(
    fp: str,
    payload: Payload,
    *,
    env: dict[str, str],
    workdir: str,
    out_fd: int,
    fds: Sequence[int] = (),
    args: Sequence = (),
    sys_path: list[str] | None = None,
) -> tuple[socket.socket, int]:
    """Asks the live server ``fp`` for a child running ``payload`` (see :func:`ask`). Returns (the
    connection to keep open while the child is used: the server kills the child when it closes, the
    child's pid)."""
    conn = connect(os.path.join(home(), f"{fp}.sock"))
    if conn is None:
        raise ConnectionError(f"the warm server {fp} does not answer")
    try:
        pid, _ = ask(conn, payload, env=env, workdir=workdir, out_fd=out_fd, fds=fds, args=args, sys_path=sys_path)
    except BaseException:
        conn.close()
        raise
    return conn, pid
