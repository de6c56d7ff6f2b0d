"""Leases in a store: a JSON file that says a process is at work on something, kept alive by a heartbeat.

Two kinds:

- :func:`lease`: a shared one (many may hold theirs side by side, each its own file), which says
  "in use" to the store's cleanup and to other writers: ``data/<key>/_writing-<attempt>.json``
  while a fit writes data, ``data/<key>/_reading-<fit>.json`` while a fit trains on it;
- :func:`exclusive_lease`: the only one at its path (``runs/<run_id>/_writer.json``: one fit trains a
  run at a time), taken over once its holder stopped beating.

:func:`live_leases` reads them: a lease whose heartbeat is older than its staleness is a holder that
died. A lease records its holder's process too (:func:`holder_record`: host, boot, pid namespace, pid and the
process's start time): on the holder's own host (same boot and pid namespace), a lease whose process
is gone (its pid dead, or reused by a later process) is dead at once, whatever its heartbeat's age
(:func:`holder_gone`). Every read and write goes through the store's files (``data/files.py``), under
its retry policy.
"""

import contextlib
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hvd_spark._internal.common import retry
from hvd_spark._internal.data.files import StoreFiles

logger = logging.getLogger(__name__)

_HELD_TOKENS: set[str] = set()  # the tokens of the exclusive leases this process holds right now


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pid_started_at(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, from ``/proc/<pid>/stat``), or None
    (no such process, or no ``/proc``)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command's name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_record() -> dict[str, Any]:
    """This process as a lease records it. ``boot`` and ``pidns`` tell this host's processes from
    those of another container with the same host name (another pid namespace) or of a reboot."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _pid_namespace(),
        "pid_started": pid_started_at(pid),
    }


def holder_gone(doc: dict[str, Any]) -> bool:
    """Whether the process that holds the lease ``doc`` is known to be gone: it ran on this host (the
    same host name, boot and pid namespace) and its pid is dead, or now belongs to a process started
    later. A lease from another host, or one that does not say, is judged by its heartbeat only."""
    here = holder_record()
    if any(doc.get(k) is None or doc.get(k) != here[k] for k in ("host", "boot", "pidns")):
        return False
    try:
        pid = int(doc["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    started = pid_started_at(pid)
    if started is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            return False
        return False  # alive, and no /proc to say when it started
    return doc.get("pid_started") is not None and str(doc["pid_started"]) != started


def _left_lease(path: str, error: BaseException) -> None:
    logger.warning(
        "could not remove the lease %s (%s: %s); it expires once its heartbeat is old enough",
        path,
        type(error).__name__,
        error,
    )


class LeaseHeldError(Exception):
    """The lease at ``path`` is held by a live process, described by ``holder`` (its lease file)."""

    def __init__(self, path: str, holder: dict[str, Any]):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {holder.get('host', '?')} (pid {holder.get('pid', '?')})")


@dataclass(frozen=True)
class Lease:
    """An exclusive lease this process holds: its file, its token, and whether it was lost."""

    path: str
    token: str
    lost: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def lease(files: StoreFiles, path: str, heartbeat: float, **info):
    """Holds a lease file at ``path`` while the block runs: a JSON with ``info``, this host and
    process, refreshed every ``heartbeat`` seconds by a daemon thread, removed at the end.

    Others read it with :func:`live_leases` to tell a writer in progress from one that died
    (whose heartbeat stops).
    """
    doc = dict(info, **holder_record(), started=time.time())

    def beat() -> bool:
        with contextlib.suppress(Exception), retry.at_most(heartbeat):  # a missed one: the next retries
            files.write_json(path, dict(doc, heartbeat=time.time()))
        return True

    beat()
    try:
        with _beating(path, heartbeat, beat):
            yield
    finally:
        try:
            with retry.at_most(heartbeat):
                files.rm(path)
        except Exception as e:  # the store is unreachable: the block's own outcome matters more
            _left_lease(path, e)


@contextlib.contextmanager
def _beating(path: str, heartbeat: float, beat: Callable[[], bool]):
    """Calls ``beat()`` every ``heartbeat`` seconds from a daemon thread while the block runs, until
    it returns False (the lease at ``path`` was lost)."""
    stop = threading.Event()

    def run():
        while not stop.wait(heartbeat):
            if not beat():
                return

    thread = threading.Thread(target=run, name=f"hvd_spark-lease-{posixpath.basename(path)}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=heartbeat + 5)


@contextlib.contextmanager
def exclusive_lease(files: StoreFiles, path: str, heartbeat: float, stale: float, **info):
    """Holds the only lease at ``path`` while the block runs, or raises :class:`LeaseHeldError`
    with the holder's lease when another process holds it (its heartbeat younger than ``stale``
    seconds). A lease whose holder stopped beating (its process or host died) is taken over, and so
    at once is one whose holder's process is gone from this host (:func:`holder_gone`).

    The lease carries a random token; the heartbeat thread rewrites it only while it still holds
    that token, and the end removes it only then, so a holder that lost its lease (it was taken
    over after a long stall) never removes its successor's.
    """
    token = uuid.uuid4().hex
    doc = dict(info, **holder_record(), started=time.time(), token=token)

    def current() -> dict[str, Any] | None:
        try:
            return files.read_json(path)
        except (FileNotFoundError, ValueError):  # released meanwhile / being replaced
            return None

    created = files.create_exclusive_json(path, dict(doc, heartbeat=time.time()))
    if created and not files.is_local:  # an object store's create is check-then-write: read it back
        time.sleep(0.2)
        mine = current()
        if mine is None or mine.get("token") != token:
            raise LeaseHeldError(path, mine or {})
    if not created:
        held = current()
        # This process's own lease that it could not remove (the store was down then) is not held.
        ours_left = held is not None and (held.get("host"), held.get("pid")) == (doc["host"], doc["pid"])
        if (
            held is not None
            and time.time() - float(held.get("heartbeat", 0)) < stale
            and not (ours_left and held.get("token") not in _HELD_TOKENS)
            and not holder_gone(held)
        ):
            raise LeaseHeldError(path, held)
        if held is not None and not ours_left:
            age = time.time() - float(held.get("heartbeat", 0))
            why = "its process is gone from this host" if holder_gone(held) else f"no heartbeat for {age:.0f}s"
            logger.warning("taking over %s from %s (pid %s): %s", path, held.get("host"), held.get("pid"), why)
        files.write_json(path, dict(doc, heartbeat=time.time()))  # stale: its holder is gone
        time.sleep(0.2)
        mine = current()
        if mine is None or mine.get("token") != token:  # another process took it over at the same time
            raise LeaseHeldError(path, mine or {})

    handle = Lease(path, token)

    def beat() -> bool:
        try:
            with retry.at_most(heartbeat):
                held = current()
        except Exception:  # the store is unreachable for now: try again at the next heartbeat
            return True
        if held is None or held.get("token") != token:
            handle.lost.set()  # taken over (this holder stalled for longer than ``stale``) or removed
            logger.error("the lease %s was lost (now %s)", path, held and f"held by pid {held.get('pid')}")
            return False
        with contextlib.suppress(Exception), retry.at_most(heartbeat):  # a missed one: the next retries
            files.write_json(path, dict(doc, heartbeat=time.time()))
        return True

    _HELD_TOKENS.add(token)
    try:
        with _beating(path, heartbeat, beat):
            yield handle
    finally:
        _HELD_TOKENS.discard(token)
        try:
            with retry.at_most(heartbeat):
                held = current()
                if held is not None and held.get("token") == token:
                    files.rm(path)
        except Exception as e:  # the store is unreachable: the block's own outcome matters more
            _left_lease(path, e)


def live_leases(files: StoreFiles, folder: str, prefix: str, stale: float) -> list[dict[str, Any]]:
    """The leases ``folder/<prefix>*.json`` whose heartbeat is younger than ``stale`` seconds and whose
    holder is not known to be gone (:func:`holder_gone`)."""
    out = []
    for name in files.listdir(folder):
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        with contextlib.suppress(FileNotFoundError, ValueError):  # released meanwhile / being replaced
            doc = files.read_json(posixpath.join(folder, name))
            if time.time() - float(doc.get("heartbeat", 0)) < stale and not holder_gone(doc):
                out.append(dict(doc, name=name))
    return out
