"""Issue 28: what a launcher costs on top of the training it runs, for hvd_spark and the other
ways to run the same Keras / PyTorch job, each in its own process, side by side in this script.

The task (identical everywhere): digits (1,797 rows, 64 features), MLP 64 -> 64 -> 10, Adam 1e-3,
2 ranks x batch 32 (plain Keras: one process, batch 64, the same 29 steps an epoch), 10 epochs,
one TensorFlow / torch thread per rank, ``local[2]`` for the Spark launchers. Systems:

- hvd_spark ``HorovodEstimator`` (project venv): a cold fit (no warm server on the machine, first
  fit of a new session) and a warm one (second fit, same session); transform of all rows;
- plain Keras in a fresh process (project venv): the floor;
- horovod.spark's ``KerasEstimator`` (its own venv: pyspark 3.5.9, pyarrow 10, tf_keras, Horovod
  0.28.1; ``benchmarks/baselines/setup.sh``), cold and warm fit, transform;
- Horovod's own launcher, ``horovod.run`` over Gloo without Spark (the same venv);
- Spark's ``TorchDistributor`` (its own venv: pyspark 4.3, CPU torch), the MLP in PyTorch.

Per system: time to the first step and whole-job time from the launcher call, the training time
(rank 0's first to last step), the overhead (whole - training) and transform time; then, per
system, a run where rank 1 SIGKILLs itself after epoch 2 and what happened (finished after a
restart, or failed) and when. A step-cost sweep (hvd_spark, 2 ranks on 2 cores) varies
``spark.task.cpus`` and TensorFlow's intra-/inter-op threads against plain Keras' step.

    python -m benchmarks.bench_overhead [--quick] [--only main,kill,steps]

Systems whose venv is missing are skipped with the reason (``bash benchmarks/baselines/setup.sh``
builds them; it needs the Horovod wheel of ``bash scripts/setup.sh``).
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.common import RESULTS, stats, write

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join(HERE, "baselines")
CACHE = os.environ.get("HVD_SPARK_CACHE") or os.path.expanduser("~/.cache/hvd_spark")
LEGACY_PY = os.path.join(CACHE, "bench", "horovod-spark", "bin", "python")
TORCH_PY = os.path.join(CACHE, "bench", "torch", "bin", "python")
STEPS_PER_EPOCH = 29
SECTIONS = ("main", "kill", "steps")


def _systems() -> list[dict]:
    me = sys.executable
    return [
        {"name": "hvd_spark", "python": me, "script": "hvd_spark_keras.py", "spark": True},
        {"name": "plain Keras", "python": me, "script": "plain_keras.py", "spark": False},
        {
            "name": "horovod.spark KerasEstimator",
            "python": LEGACY_PY,
            "script": "horovod_spark_keras.py",
            "spark": True,
        },
        {"name": "horovod.run (Gloo, no Spark)", "python": LEGACY_PY, "script": "horovodrun_keras.py", "spark": False},
        {"name": "TorchDistributor", "python": TORCH_PY, "script": "torch_distributor.py", "spark": True},
    ]


def _kill_warm_servers() -> None:
    """Ends every warm server of hvd_spark on the machine: the next fit starts cold."""
    import psutil

    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] == ["-m", "hvd_spark._internal.task.warm"] and p.info["uids"].real == os.getuid():
            with contextlib.suppress(psutil.NoSuchProcess):  # it ended on its own meanwhile
                p.kill()
    time.sleep(0.5)


def _run(system: dict, args: list[str], timeout: float = 300.0) -> dict:
    """Runs one baseline script in its venv; its JSON line, with the wall time seen from here."""
    _kill_warm_servers()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    if system["python"] == sys.executable:
        env["PYSPARK_PYTHON"] = sys.executable
    t0 = time.time()
    # Its own session: whatever the script leaves running (a JVM, workers) is stopped before the
    # next system runs, so no run shares the 2 cores with the previous one's leftovers.
    proc = subprocess.Popen(
        [system["python"], os.path.join(BASE, system["script"]), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", "timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        tail = "\n".join((err or "").strip().splitlines()[-5:])
        return {
            "outcome": "failed",
            "error": f"no result line; stderr tail: {tail}",
            "process_wall_s": time.time() - t0,
        }
    result = json.loads(lines[-1])
    result["t_process_launch"] = t0
    result["process_wall_s"] = time.time() - t0
    return result


def _launch_begin(r: dict) -> float | None:
    return r.get("t_fit_begin") or r.get("t_run_begin")


def _step_ms(r: dict) -> float | None:
    """Median over epochs 2.. of rank 0's step time from batch 1 to the last batch's start (the
    runner's ``step_ms_per_epoch``): whole batches, without the epoch boundaries' own work."""
    per_epoch = (r.get("step_ms_per_epoch") or [])[1:]  # the first epoch traces the step
    return statistics.median(per_epoch) if per_epoch else None


def figures(r: dict) -> dict:
    """Seconds from the launcher call: first step, whole job, training, overhead; transform."""
    begin = _launch_begin(r)
    f: dict = {"outcome": r.get("outcome"), "accuracy": r.get("accuracy")}
    if begin is None or r.get("outcome") != "finished":
        f["error"] = r.get("error")
        return f
    f["first_step_s"] = r["t_first_step"] - begin if r.get("t_first_step") else None
    f["whole_s"] = r["t_end"] - begin
    if r.get("t_train_begin") and r.get("t_train_end"):
        f["training_s"] = r["t_train_end"] - (r.get("t_first_step") or r["t_train_begin"])
        f["overhead_s"] = f["whole_s"] - f["training_s"]
    if r.get("t_predict_begin") and r.get("t_predict_end"):
        f["transform_s"] = r["t_predict_end"] - r["t_predict_begin"]
    f["step_ms"] = _step_ms(r)
    f["process_wall_s"] = r.get("process_wall_s")
    return f


def main_section(repeats: int) -> dict:
    out: dict = {}
    for system in _systems():
        name = system["name"]
        if not os.path.exists(system["python"]):
            out[name] = {"skipped": f"{system['python']} is missing: run bash benchmarks/baselines/setup.sh"}
            continue
        out[name] = {"runs": []}
    for _ in range(repeats):  # paired: each repeat runs every system once, in turn
        for system in _systems():
            entry = out[system["name"]]
            if "skipped" in entry:
                continue
            r = _run(system, [])
            if r.get("versions"):
                entry.setdefault("versions", r["versions"])
            run = {"cold": figures(r), "raw": r}
            if "warm_fit" in r:
                run["warm"] = figures(dict(r["warm_fit"], outcome=r["warm_fit"].get("outcome")))
            entry["runs"].append(run)
            print(f"  {system['name']}: {run['cold']}", file=sys.stderr, flush=True)
    for entry in out.values():
        if "runs" not in entry:
            continue
        for phase in ("cold", "warm"):
            runs = [run[phase] for run in entry["runs"] if phase in run and run[phase].get("outcome") == "finished"]
            if not runs:
                continue
            entry[phase] = {
                k: stats([run[k] for run in runs])
                for k in (
                    "first_step_s",
                    "whole_s",
                    "training_s",
                    "overhead_s",
                    "transform_s",
                    "step_ms",
                    "process_wall_s",
                )
                if all(run.get(k) is not None for run in runs)
            }
            entry[phase]["accuracy"] = [run.get("accuracy") for run in runs]
    return out


def kill_section() -> dict:
    """Rank 1 SIGKILLs itself after epoch 2: what each system does, and when."""
    out: dict = {}
    for system in _systems():
        if system["name"] == "plain Keras":
            continue
        if not os.path.exists(system["python"]):
            out[system["name"]] = {"skipped": "venv missing"}
            continue
        r = _run(system, ["--kill-after-epoch", "2", "--timeout", "240"], timeout=300)
        begin = _launch_begin(r)
        entry = {"outcome": r.get("outcome"), "error": r.get("error"), "accuracy": r.get("accuracy")}
        if r.get("t_kill") and r.get("t_end"):
            entry["kill_to_end_s"] = r["t_end"] - r["t_kill"]
        if begin and r.get("t_end"):
            entry["whole_s"] = r["t_end"] - begin
        if r.get("t_restart_train_begin") and r.get("t_kill"):
            entry["kill_to_training_again_s"] = r["t_restart_train_begin"] - r["t_kill"]
        entry["restarts"] = r.get("restarts")
        out[system["name"]] = entry
        print(f"  kill: {system['name']}: {entry}", file=sys.stderr, flush=True)
    return out


STEP_SETTINGS = [
    # (label, master, spark.task.cpus, TF intra,inter or None for hvd_spark's default)
    ("task.cpus=1 (default: 1 intra, 1 inter)", "local[2]", 1, None),
    ("task.cpus=1, intra 1, inter 2", "local[2]", 1, "1,2"),
    ("task.cpus=1, intra 2, inter 1", "local[2]", 1, "2,1"),
    ("task.cpus=1, intra 2, inter 2", "local[2]", 1, "2,2"),
    ("task.cpus=2 on local[4] (2 intra, 2 inter)", "local[4]", 2, None),
]


def steps_section(repeats: int) -> dict:
    me = sys.executable
    hvd = {"name": "hvd_spark", "python": me, "script": "hvd_spark_keras.py"}
    plain = {"name": "plain Keras", "python": me, "script": "plain_keras.py"}
    out: dict = {"hvd_spark_2_ranks": {}, "plain_keras_1_process": {}}
    for _ in range(repeats):
        for label, master, cpus, threads in STEP_SETTINGS:
            args = ["--no-warm-fit", "--master", master, "--task-cpus", str(cpus)]
            args += ["--threads", threads] if threads else []
            r = _run(hvd, args)
            out["hvd_spark_2_ranks"].setdefault(label, []).append(_step_ms(r))
            print(f"  steps: {label}: {_step_ms(r)}", file=sys.stderr, flush=True)
        for threads in (1, 2):
            r = _run(plain, ["--batch", "32", "--threads", str(threads)])
            out["plain_keras_1_process"].setdefault(f"batch 32, {threads} thread(s)", []).append(_step_ms(r))
    for group in out.values():
        for label, samples in list(group.items()):
            good = [s for s in samples if s is not None]
            group[label] = stats(good) if good else {"failed": len(samples)}
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="issue 28's overhead table")
    p.add_argument("--quick", action="store_true", help="one repeat")
    p.add_argument("--only", default=",".join(SECTIONS), help="sections: main, kill, steps")
    args = p.parse_args()
    repeats = 1 if args.quick else 3
    only = set(args.only.split(","))
    data: dict = {
        "what": "digits MLP (1,797 rows, 64-64-10), 2 ranks x batch 32, 10 epochs, local[2], 1 thread per rank",
        "repeats": repeats,
    }
    if "main" in only:
        data["systems"] = main_section(repeats)
        s = data["systems"]

        def med(name, phase, key):
            return ((s.get(name) or {}).get(phase) or {}).get(key, {}).get("median")

        hs, hv = "horovod.spark KerasEstimator", "hvd_spark"
        ratios = {}
        for key, (a, pa, b, pb) in {
            "cold_fit_horovod_spark_over_hvd_spark": (hs, "cold", hv, "cold"),
            "warm_fit_horovod_spark_over_hvd_spark": (hs, "warm", hv, "warm"),
        }.items():
            x, y = med(a, pa, "whole_s"), med(b, pb, "whole_s")
            ratios[key] = x / y if x and y else None
        x, y = med(hs, "cold", "transform_s"), med(hv, "cold", "transform_s")
        ratios["cold_transform_horovod_spark_over_hvd_spark"] = x / y if x and y else None
        ratios["hvd_spark_warm_fit_s"] = med(hv, "warm", "whole_s")
        data["targets"] = {
            "warm_fit_s_at_most": 3.0,
            "cold_fit_ratio_at_least": 5.0,
            "cold_transform_ratio_at_least": 3.0,
            "measured": ratios,
        }
    if "kill" in only:
        data["kill_rank_1_after_epoch_2"] = kill_section()
    if "steps" in only:
        data["step_repeats"] = 1 if args.quick else 3
        data["step_cost_ms"] = steps_section(data["step_repeats"])
    print(json.dumps({k: v for k, v in data.items() if k != "systems"}, indent=1, default=str), file=sys.stderr)
    if only != set(SECTIONS):  # a partial run keeps the other sections of the last results
        previous = os.path.join(RESULTS, "overhead.json")
        if os.path.exists(previous):
            with open(previous) as f:
                kept = json.load(f)
            kept.pop("environment", None)
            data = dict(kept, **data)
    write("overhead", data)


if __name__ == "__main__":
    main()
