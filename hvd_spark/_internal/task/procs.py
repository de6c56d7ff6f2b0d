"""Child processes of a task: started in their own process group, killed with it, never orphaned."""

import ctypes
import os
import signal
import subprocess


def die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the task's process dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return  # not Linux: the task's own kill on exit still applies


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
