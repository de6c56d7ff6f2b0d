"""Elastic training on a real cluster: ``local-cluster`` with three executor JVMs, one executor
killed with SIGKILL in the middle of an epoch.

The fit goes on with two ranks from its latest commit inside the epoch, without waiting for the lost
slot; when the executor comes back it grows to three ranks at the next epoch end. Every rank appends
the rows of each batch it reads to a trace (``HVD_SPARK_DATA_TRACE``); a batch counts as trained when
the attempt that read it was not rolled back past it (the next attempt started after it). Per epoch, no
row is trained twice and at most ``size - 1`` are left out.

A SparkContext per process only, so the fit runs in a fresh Python process (``run_result_script``).
"""

import json
import os
import pathlib
import textwrap

import pytest
from _helpers import run_result_script

pytestmark = pytest.mark.cluster

ROWS = 2400
EPOCHS = 6  # the executor returns after the two-rank attempt's first commit; a grow needs an epoch end after that

_TEMPLATE = textwrap.dedent("""
    import json, os, signal, subprocess, sys, threading, time
    import numpy as np
    import hvd_spark
    from pyspark.sql import functions as F
    IMPORTS

    store, trace = sys.argv[1], sys.argv[2]
    spark = hvd_spark.local_session(
        "local-cluster[3,1,1024]",
        conf={"spark.executor.memory": "700m", "spark.executorEnv.HVD_SPARK_DATA_TRACE": trace},
    )
    spark.sparkContext.setLogLevel("ERROR")
    sc = spark.sparkContext
    jsc = sc._jsc.sc()

    def set_executors(n):
        empty = getattr(getattr(sc._jvm.scala.collection.immutable, "Map$"), "MODULE$").empty()
        return jsc.requestTotalExecutors(n, 0, empty)

    DEFINITIONS

    try:
        n = ROWS
        df = (
            spark.range(n, numPartitions=6)
            .withColumn("k", (F.col("id") * 7919) % 17)
            .repartition(5, "k")  # a shuffle upstream
            .withColumn("x", F.array(F.col("id").cast("double"), F.sin("id")))
            .withColumn("y", (F.sin("id") * 2.0).cast("double"))
        )
        ESTIMATOR
        killed = {}

        def killer():
            ckpts = os.path.join(store, "runs", "elastic", "checkpoints")
            while not any(f.startswith("epoch-0001-step-") and f.endswith(".json")
                          for f in (os.listdir(ckpts) if os.path.isdir(ckpts) else [])):
                time.sleep(0.1)
            set_executors(2)  # the lost executor is not replaced: training must go on without it
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            pids = [int(line.split()[0]) for line in ps.splitlines()
                    if "CoarseGrainedExecutorBackend" in line and sc.applicationId in line]
            killed["pid"], killed["at"] = pids[-1], time.time()
            os.kill(pids[-1], signal.SIGKILL)
            # once the two-rank attempt has made a commit, the executor may come back
            seen = set(os.listdir(ckpts))
            while not (set(os.listdir(ckpts)) - seen):
                time.sleep(0.1)
            set_executors(3)
            killed["returned"] = time.time()

        threading.Thread(target=killer, daemon=True).start()
        fitted = est.fit(df)
        summary = fitted.getFitSummary()
        print("RESULT " + json.dumps({
            "killed": killed,
            "recoveries": [r.__dict__ for r in summary.recoveries],
            "ranks": [r.rank for r in summary.ranks],
            "digests": sorted({r.weights_digest for r in summary.ranks}),
            "epochs": len(fitted.getHistory()["loss"]),
            "loss": fitted.getHistory()["loss"],
            "restarts": summary.restarts,
        }))
    finally:
        spark.stop()
""")


def elastic_script(imports: str, definitions: str, estimator: str) -> str:
    """The elastic fit's script (run in a fresh process, ``run_result_script``): a ``local-cluster`` session
    of three executors, a table of ``ROWS`` rows ``x`` (2 values) -> ``y`` behind a shuffle, the framework's
    ``imports``, ``definitions`` (classes) and ``estimator`` (statements making ``est``, a fit of run
    ``elastic`` whose steps are slowed down), one executor killed once the first commit inside epoch 2
    exists and given back once the two-rank attempt committed; prints ``RESULT`` with the recoveries."""
    import textwrap as tw

    return (
        _TEMPLATE.replace("IMPORTS", tw.dedent(imports).strip())
        .replace("\nDEFINITIONS\n", "\n" + tw.dedent(definitions).strip() + "\n")
        .replace("    ESTIMATOR", tw.indent(tw.dedent(estimator).strip(), "    "))
        .replace("ROWS", str(ROWS))
        .replace("EPOCHS", str(EPOCHS))
    )


SCRIPT = elastic_script(
    "import keras",
    """
    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.03)
    """,
    """
    inp = keras.Input((2,))
    out = keras.layers.Dense(1)(keras.layers.Rescaling([1.0 / n, 1.0])(inp))
    model = keras.Model(inp, out)
    est = hvd_spark.HorovodEstimator(
        store=store, model=model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
        feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=EPOCHS, shuffle=True,
        shuffle_buffer_size=300, min_num_proc=2, max_num_proc=3, max_restarts=2,
        checkpoint_every=10, elastic_timeout=300, callbacks=[Slow()], verbose=1, run_id="elastic",
    )
    """,
)


def _trained_rows(trace_dir: pathlib.Path):
    """Per epoch, the ids of the batches that stayed trained: an attempt's batches up to where the next
    attempt started (its first batch's epoch and step); the last attempt's all."""
    attempts = []
    for f in trace_dir.glob("*.jsonl"):
        records = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if records:
            attempts.append(records)
    # one file per rank process; the ranks of one attempt start together and share a world size
    by_start: dict[tuple, list] = {}
    for records in attempts:
        first = min(records, key=lambda r: (r["epoch"], r["step"]))
        key = (round(min(r["t"] for r in records)), first["epoch"], first["step"], first["size"])
        by_start.setdefault(key, []).extend(records)
    groups = sorted(by_start.items(), key=lambda kv: kv[0][0])
    merged: list[list] = []
    for (t, epoch, step, size), records in groups:  # ranks of one attempt start within a few seconds
        if merged and merged[-1][0][1:] == (epoch, step, size) and t - merged[-1][0][0] < 30:
            merged[-1][1].extend(records)
        else:
            merged.append([(t, epoch, step, size), records])
    trained: dict[int, list[int]] = {}
    starts = []
    for i, ((_, epoch, step, size), records) in enumerate(merged):
        starts.append((epoch, step, size))
        nxt = merged[i + 1][0][1:3] if i + 1 < len(merged) else None
        for r in records:
            if nxt is None or (r["epoch"], r["step"]) < tuple(nxt):
                trained.setdefault(r["epoch"], []).extend(int(v) for v in r["ids"])
    return trained, starts


def run_and_check(script: str, tmp_path) -> None:
    """Runs an :func:`elastic_script` and checks the run: shrunk from 3 to 2 ranks from a commit inside
    epoch 2, grown back to 3, every epoch trained, the same weights on every rank; per epoch (from the
    ranks' data trace) no row trained twice and fewer left out than there are ranks."""
    trace = tmp_path / "trace"
    data = run_result_script(script, str(tmp_path / "store"), str(trace), cwd=tmp_path, timeout=900)
    kinds = [r["kind"] for r in data["recoveries"]]
    assert data["epochs"] == EPOCHS, data
    assert kinds[:1] == ["shrink"] and "grow" in kinds, data["recoveries"]  # 3 -> 2 after the kill, back to 3
    shrink = data["recoveries"][0]
    assert (shrink["from_size"], shrink["to_size"]) == (3, 2)
    assert shrink["resumed_from"].startswith("epoch 1 step "), shrink  # a commit inside epoch 2, not its start
    assert data["ranks"] == [0, 1, 2]  # finished on three ranks
    assert len(data["digests"]) == 1  # identical weights on every rank (fit checks it too)
    assert data["loss"][-1] < data["loss"][0]
    trained, starts = _trained_rows(trace)
    sizes = [size for _, _, size in starts]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, starts
    # the two-rank attempt read on from the commit's cursor (its first batch is the commit's next step)
    committed = int(shrink["resumed_from"].split()[-1])
    assert starts[1] == (1, committed, 2), (starts, shrink)
    assert sorted(trained) == list(range(EPOCHS))
    for epoch, ids in trained.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch + 1}: a row trained twice"
        assert set(ids) <= set(range(ROWS))
        assert ROWS - len(ids) <= 2, f"epoch {epoch + 1}: {ROWS - len(ids)} rows left out"  # < the ranks
    assert os.path.exists(tmp_path / "store" / "runs" / "elastic")


def test_a_killed_executor_shrinks_the_fit_and_its_return_grows_it(tmp_path):
    run_and_check(SCRIPT, tmp_path)
