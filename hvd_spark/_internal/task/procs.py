"""Child processes of a task: started in their own process group, killed with it, never orphaned.

A Spark task's Python process runs threads (heartbeats, output pumps, Spark's own), so nothing may
run Python code between ``fork`` and ``exec`` there: ``preexec_fn`` is documented as unsafe with
threads (a lock another thread held at the fork, such as the dynamic loader's, stays held forever in
the child). Children are therefore started without it: :func:`popen_args` gives ``subprocess.Popen``
``start_new_session=True`` (``setsid`` done by CPython's C code between fork and exec) and a command
that goes through a tiny wrapper, a fresh single-threaded ``python -s -S`` that asks the kernel to
kill it when its parent dies (``PR_SET_PDEATHSIG``), exits at once if that parent is already gone
(the race between the fork and the request) and then ``exec``s the real command, which keeps both
(the pid and the death signal survive ``exec``).

The warm server (``warm.py``) forks ranks itself: it resolves ``prctl`` before any fork
(:func:`load_prctl`), so the forked child only calls a function already resolved."""

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

# Runs as `python -s -S -c WRAPPER <parent pid> <command...>`: stdlib only, no site packages; the
# environment stays (an interpreter may need PYTHONHOME).
WRAPPER = """\
import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (ImportError, OSError, AttributeError):
    pass  # not Linux: the task's own kill on exit still applies
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + 9)  # the task died before the request took effect: nothing to run for
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:  # e.g. mpirun not installed on this executor
    sys.stderr.write(f"hvd_spark: cannot run {sys.argv[2]!r} on this host: {e}\\n")
    os._exit(127)
"""


# Runs as `python -s -S -c JANITOR <read fd> <folder>`: waits on a pipe whose other end only its task
# holds. A byte: the task removed the folder itself. End of file without one: the task's process
# died (Spark kills a cancelled task's Python worker, no `finally` runs), so the janitor removes it,
# again a moment later for what a dying rank was still writing.
JANITOR = """\
import os, shutil, sys, time
fd, path = int(sys.argv[1]), sys.argv[2]
try:
    done = os.read(fd, 1)
except OSError:
    done = b""
if not done:
    for delay in (0.0, 1.0, 3.0):
        time.sleep(delay)
        shutil.rmtree(path, ignore_errors=True)
"""


class FolderJanitor:
    """Removes ``path`` whatever way this process ends: :meth:`close` removes it at once (the task's
    ``finally``); if the process dies first (killed), a small process of its own, started here in a
    session of its own (it outlives the task by design, for a few seconds at most), removes it."""

    def __init__(self, path: str):
        self.path = path
        read_end, self._write_end = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-s", "-S", "-c", JANITOR, str(read_end), path],
                pass_fds=(read_end,),
                start_new_session=True,  # not in the task's process group: a kill of that group spares it
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(read_end)

    def close(self, timeout: float = 5.0) -> None:
        """Removes the folder, tells the janitor it is done, and reaps it (a worker Spark reuses must not
        keep zombies)."""
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.write(self._write_end, b"x")
        except OSError:  # the janitor is gone already (killed): nothing to tell
            pass
        os.close(self._write_end)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:  # it has nothing left to do: do not hold the task for it
            self._proc.kill()


def with_parent(cmd: Sequence[str], parent: int | None = None) -> list[str]:
    """``cmd`` run through the wrapper: killed by SIGKILL when ``parent`` (default: this process)
    dies, for the process ``cmd`` becomes (Linux; elsewhere ``cmd`` runs as it is)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-s", "-S", "-c", WRAPPER, str(parent or os.getpid()), *cmd]


def popen_args(cmd: Sequence[str]) -> dict[str, Any]:
    """``subprocess.Popen`` arguments for a task's child: ``cmd`` in a process group (session) of its
    own, dying with this process, with no ``preexec_fn``."""
    return {"args": with_parent(cmd), "start_new_session": True}


_prctl: Callable | None = None


def load_prctl() -> Callable | None:
    """Resolves libc's ``prctl`` (once). Call it before forking: a child of a multi-threaded
    process must not load libraries, but may call what was resolved before the fork."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            return None
    return _prctl


def die_with_parent() -> None:
    """In a forked child (not exec'd): SIGKILL it when its parent dies (Linux only). Uses the
    ``prctl`` resolved by :func:`load_prctl` before the fork; without it, does nothing."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def set_name(name: str) -> None:
    """Sets this process's name (``/proc/<pid>/comm``, 15 bytes), with the ``prctl`` resolved
    before the fork."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return str(-rc)


def kill_tree(proc, grace: float) -> None:
    """Stops a rank process and everything it started (its own process group). ``proc`` is a
    ``subprocess.Popen`` or a :class:`~hvd_spark._internal.task.warm.WarmProcess`."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
