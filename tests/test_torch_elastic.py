"""Elastic training of a torch model on a real cluster (issue 48): ``local-cluster`` with three executor
JVMs, one executor killed with SIGKILL in the middle of an epoch, as ``test_elastic.py`` does for Keras.

The fit goes on with two ranks from its latest commit inside the epoch (the data cursor), and grows back
to three at the next epoch end after the executor returns. Per epoch, from the ranks' data trace, no row
is trained twice and at most ``size - 1`` are left out.
"""

import textwrap

import pytest
from _helpers import run_result_script
from test_elastic import _trained_rows

pytest.importorskip("torch")
pytestmark = pytest.mark.cluster

ROWS = 2400
EPOCHS = 6

SCRIPT = (
    textwrap.dedent("""
    import json, os, signal, subprocess, sys, threading, time
    import numpy as np
    import torch
    import hvd_spark
    from hvd_spark.torch import TorchEstimator
    from pyspark.sql import functions as F

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

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.tensor([1.0 / ROWS, 1.0])
            self.dense = torch.nn.Linear(2, 1)

        def forward(self, x):
            if self.training:
                time.sleep(0.03)  # slow steps: the executor is killed in the middle of an epoch
            return self.dense(x * self.scale)

    try:
        n = ROWS
        df = (
            spark.range(n, numPartitions=6)
            .withColumn("k", (F.col("id") * 7919) % 17)
            .repartition(5, "k")  # a shuffle upstream
            .withColumn("x", F.array(F.col("id").cast("double"), F.sin("id")))
            .withColumn("y", (F.sin("id") * 2.0).cast("double"))
        )
        torch.manual_seed(0)
        model = Net()
        est = TorchEstimator(
            store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
            loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=EPOCHS,
            shuffle=True, shuffle_buffer_size=300, min_num_proc=2, max_num_proc=3, max_restarts=2,
            checkpoint_every=10, elastic_timeout=300, verbose=1, run_id="elastic",
        )
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
    .replace("ROWS", str(ROWS))
    .replace("EPOCHS", str(EPOCHS))
)


def test_a_killed_executor_shrinks_a_torch_fit_and_its_return_grows_it(tmp_path):
    trace = tmp_path / "trace"
    data = run_result_script(SCRIPT, str(tmp_path / "store"), str(trace), cwd=tmp_path, timeout=900)
    kinds = [r["kind"] for r in data["recoveries"]]
    assert data["epochs"] == EPOCHS, data
    assert kinds[:1] == ["shrink"] and "grow" in kinds, data["recoveries"]
    shrink = data["recoveries"][0]
    assert (shrink["from_size"], shrink["to_size"]) == (3, 2)
    assert shrink["resumed_from"].startswith("epoch 1 step "), shrink  # a commit inside epoch 2
    assert data["ranks"] == [0, 1, 2]
    assert len(data["digests"]) == 1
    assert data["loss"][-1] < data["loss"][0]
    trained, starts = _trained_rows(trace)
    sizes = [size for _, _, size in starts]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, starts
    committed = int(shrink["resumed_from"].split()[-1])
    assert starts[1] == (1, committed, 2), (starts, shrink)
    assert sorted(trained) == list(range(EPOCHS))
    for epoch, ids in trained.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch + 1}: a row trained twice"
        assert set(ids) <= set(range(ROWS))
        assert ROWS - len(ids) <= 2, f"epoch {epoch + 1}: {ROWS - len(ids)} rows left out"
