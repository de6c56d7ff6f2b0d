"""What every baseline runner shares (standard library only: each runs in its own venv, and imports
this module from its own folder): one JSON line on stdout, a watchdog, the process tree, error text.

Importing it points fd 1 at stderr for the process and every child it starts (Spark's JVM and
workers, the ranks), so that stdout carries the result line alone, written by :func:`emit`."""

import json
import os
import shutil
import signal
import sys
import threading
import time

_JSON_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
_emitted = threading.Lock()


def emit(result: dict) -> None:
    """Writes the result line once (the watchdog and the main thread may race)."""
    if _emitted.acquire(blocking=False):
        _JSON_OUT.write(json.dumps(result, sort_keys=True) + "\n")
        _JSON_OUT.flush()


def descendants(pid: int) -> list[int]:
    """Process ids of all descendants of pid, from /proc (children first in the walk order)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_descendants() -> None:
    for p in reversed(descendants(os.getpid())):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def start_watchdog(seconds: float, result: dict, work: str | None = None) -> None:
    """After ``seconds``: the result line says "hung", this script's children are killed, ``work``
    is removed and the script exits 3."""

    def fire():
        time.sleep(seconds)
        result.update(outcome="hung", t_end=time.time(), error=f"no result after {seconds:.0f} s (watchdog)")
        emit(result)
        kill_descendants()
        if work:
            shutil.rmtree(work, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=fire, daemon=True).start()


def compare_rank_weights(work: str, num_proc: int) -> dict:
    """weights_max_abs_diff_between_ranks: 0.0 when the ranks ended with the same weights (gradients
    averaged every step); clearly above 0 when each rank trained on its own."""
    import numpy as np

    paths = [os.path.join(work, f"weights_rank{r}.npz") for r in range(num_proc)]
    if not all(os.path.exists(p) for p in paths):
        return {}
    loaded = [np.load(p) for p in paths]
    diff = max(float(np.abs(loaded[0][k] - other[k]).max()) for other in loaded[1:] for k in loaded[0].files)
    return {"weights_max_abs_diff_between_ranks": diff}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


def detail(exc: BaseException) -> str:
    """The exception's message on one line, cut at 400 characters (Horovod names the rank and its
    exit code on the lines after the first)."""
    return " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:400]


def proc_start_time() -> float:
    """When this process was started (epoch seconds, 10 ms resolution), from /proc."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


def ship_by_value() -> None:
    """Functions of this module that a rank calls (``proc_start_time``) travel inside the pickled
    training function: the ranks' processes cannot import this folder's modules."""
    import importlib

    for name in ("cloudpickle", "pyspark.cloudpickle"):
        try:
            importlib.import_module(name).register_pickle_by_value(sys.modules[__name__])
        except (ImportError, AttributeError):
            pass
