"""Time to recover from a lost executor: elastic continuation against a restart from the epoch's start,
side by side in one run.

Both fits train the same model on the same data on ``local-cluster[3,1,...]`` (three executor JVMs),
and in both one executor is killed with SIGKILL once the second epoch has made 20 steps:

- ``restart`` (what a fit did before elastic training): ``num_proc=3``, ``max_restarts=1``, epoch
  checkpoints only. Spark replaces the killed executor; the next attempt waits for three slots and
  starts the second epoch again from its first step.
- ``elastic``: ``min_num_proc=2, max_num_proc=3``, ``checkpoint_every=10``. The killed executor is not
  replaced (the application's executor target is lowered first, as when a node is gone); the next
  attempt starts at once on the two slots left, from the latest commit inside the epoch.

Reported per mode (from ``getFitSummary().recoveries``): ``seconds`` from the failure to the next
attempt's first step, ``steps_redone`` (optimizer steps of the lost attempt past the commit it resumed
from) and the work lost, ``seconds + steps_redone x step time``; and the ratio elastic / restart.

    python -m benchmarks.bench_elastic [--quick]
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from benchmarks.common import cli, write

SCRIPT = textwrap.dedent("""
    import json, os, signal, subprocess, sys, threading, time
    import keras
    import hvd_spark
    from pyspark.sql import functions as F

    mode, store, rows, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spark = hvd_spark.local_session("local-cluster[3,1,1024]", conf={"spark.executor.memory": "700m"})
    spark.sparkContext.setLogLevel("ERROR")
    sc = spark.sparkContext

    def set_executors(n):
        empty = getattr(getattr(sc._jvm.scala.collection.immutable, "Map$"), "MODULE$").empty()
        return sc._jsc.sc().requestTotalExecutors(n, 0, empty)

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.02)  # a step of a larger model: ~20 ms more per step

    try:
        df = (spark.range(rows, numPartitions=6)
              .withColumn("x", F.array(*[F.sin(F.col("id") * (k + 1)) for k in range(16)]))
              .withColumn("y", F.cos("id").cast("double")))
        inp = keras.Input((16,))
        h = keras.layers.Dense(64, activation="relu")(inp)
        model = keras.Model(inp, keras.layers.Dense(1)(h))
        common = dict(store=store, model=model, optimizer="adam", loss="mse", feature_cols=["x"],
                      label_cols=["y"], batch_size=32, epochs=epochs, callbacks=[Steps()], verbose=0,
                      run_id="bench", max_restarts=1)
        if mode == "elastic":
            est = hvd_spark.HorovodEstimator(min_num_proc=2, max_num_proc=3, checkpoint_every=10, **common)
        else:
            est = hvd_spark.HorovodEstimator(num_proc=3, **common)
        killed = {}

        def killer():
            ckpts = os.path.join(store, "runs", "bench", "checkpoints")
            # the second epoch is under way once epoch 1's checkpoint exists; then 20 more steps
            while not os.path.exists(os.path.join(ckpts, "epoch-0001.json")):
                time.sleep(0.05)
            time.sleep(20 * 0.03 * 1.5)
            if mode == "elastic":
                set_executors(2)
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            pids = [int(l.split()[0]) for l in ps.splitlines()
                    if "CoarseGrainedExecutorBackend" in l and sc.applicationId in l]
            killed["at"] = time.time()
            os.kill(pids[-1], signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        t0 = time.time()
        fitted = est.fit(df)
        summary = fitted.getFitSummary()
        print("RESULT " + json.dumps({
            "fit_s": time.time() - t0, "killed_at": killed.get("at"),
            "steps_per_epoch": summary.steps_per_epoch,
            "recoveries": [r.__dict__ for r in summary.recoveries],
            "ranks": len(summary.ranks),
            "train_s": summary.ranks[0].train_seconds,
            "steps": summary.ranks[0].iterations - summary.ranks[0].start_iterations,
        }))
    finally:
        spark.stop()
""")


def run_mode(mode: str, rows: int, epochs: int) -> dict:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1", TF_CPP_MIN_LOG_LEVEL="2")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode, os.path.join(tmp, "store"), str(rows), str(epochs)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=tmp,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def summarize(result: dict) -> dict:
    rec = result["recoveries"][0] if result["recoveries"] else {}
    # a step's time in the last attempt: rank 0's time inside model.fit over its optimizer steps
    step_s = result["train_s"] / result["steps"] if result["train_s"] and result["steps"] else None
    seconds, redone = rec.get("seconds"), rec.get("steps_redone")
    lost = seconds + redone * step_s if None not in (seconds, redone, step_s) else None
    return {
        "recovery": rec,
        "recover_s": seconds,
        "steps_redone": redone,
        "step_s": step_s,
        "work_lost_s": lost,
        "fit_s": result["fit_s"],
        "final_ranks": result["ranks"],
    }


def main(quick: bool = False) -> dict:
    rows, epochs = (6000, 3) if quick else (12000, 3)
    out = {"rows": rows, "epochs": epochs, "modes": {}}
    for mode in ("restart", "elastic"):
        out["modes"][mode] = summarize(run_mode(mode, rows, epochs))
        print(mode, json.dumps(out["modes"][mode], indent=1))
    r, e = out["modes"]["restart"], out["modes"]["elastic"]
    for key in ("recover_s", "work_lost_s", "steps_redone"):
        if r.get(key) and e.get(key) is not None:
            out[f"ratio_{key}"] = e[key] / r[key]
    path = write("elastic", out)
    print("written", path)
    return out


if __name__ == "__main__":
    cli(main)
