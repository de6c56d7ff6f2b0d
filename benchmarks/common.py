"""Shared helpers: Spark session, timing statistics, result files."""

import json
import os
import platform
import statistics
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def session(master: str, **conf):
    import hvd_spark

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    s = hvd_spark.local_session(
        master, app_name="hvd_spark-bench", conf={k.replace("_", "."): v for k, v in conf.items()}
    )
    s.sparkContext.setLogLevel("ERROR")
    return s


def stats(samples: list[float]) -> dict[str, float]:
    """Median and spread (min, max, and the interquartile range when there are 4+ samples)."""
    s = sorted(samples)
    out = {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s)}
    if len(s) >= 4:
        q = statistics.quantiles(s, n=4)
        out["iqr"] = q[2] - q[0]
    return out


def environment() -> dict[str, str]:
    import importlib.metadata as md

    env = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": str(os.cpu_count()),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    for pkg in ("tensorflow-cpu", "horovod", "pyspark", "pyarrow", "numpy", "pandas", "petastorm", "keras"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        with open("/proc/meminfo") as f:
            env["memory_gib"] = f"{int(f.readline().split()[1]) / 1024 / 1024:.0f}"
    except OSError:
        pass
    return env


def write(name: str, data: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    data = dict(data, environment=environment())
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return path


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def mib(n_bytes: float) -> str:
    if n_bytes >= 1 << 20:
        return f"{n_bytes / (1 << 20):g} MiB"
    return f"{n_bytes / 1024:g} KiB"


def cli(main) -> None:
    """The command line every benchmark script shares: ``[--quick]``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    main(p.parse_args().quick)


def run_in_group(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, int | None, float]:
    """Runs ``cmd`` in a session (process group) of its own and kills the whole group when it ends or
    after ``timeout`` seconds (a job's leftovers: a JVM, torchrun, ranks). Returns its stdout, stderr
    (or the timeout's message), exit code and wall time seen from here."""
    import contextlib
    import signal
    import subprocess

    t0 = time.time()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timeout after {timeout:g} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return out, err, proc.returncode, time.time() - t0
