"""GPU scheduling to ranks, simulated: no GPU exists on these machines.

What is real: Spark's resource scheduling on ``local-cluster`` (two Workers, two executor JVMs),
with a fake GPU discovery script (an ``echo`` of JSON, as Spark's and horovod's own tests do) that
gives each Worker one GPU address; hvd_spark's barrier tasks, rank processes and Horovod over Gloo.
What is simulated: the GPUs themselves (TensorFlow here is the CPU build, so a rank's
``CUDA_VISIBLE_DEVICES`` selects nothing) and NCCL (this Horovod is built without it; the NCCL
decision is unit-tested in tests/fast/test_topology.py).
"""

import textwrap

import pytest
from _helpers import run_result_script  # noqa: E402

pytestmark = pytest.mark.cluster

DISCOVERY = textwrap.dedent("""\
    #!/bin/bash
    # Fake GPU discovery: each call (one per Worker) hands out the next address.
    dir=$(dirname "$0")
    exec 9>"$dir/counter.lock"
    flock 9
    n=$(cat "$dir/counter" 2>/dev/null || echo 0)
    echo $((n + 1)) > "$dir/counter"
    echo "{\\"name\\": \\"gpu\\", \\"addresses\\": [\\"$n\\"]}"
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import hvd_spark

    def rank_env():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
        keys = ("CUDA_VISIBLE_DEVICES", "HVD_SPARK_GPUS", "TF_FORCE_GPU_ALLOW_GROWTH", "HOROVOD_GPU_OPERATIONS")
        return {"rank": hvd.rank(), "sum": total, **{k: os.environ.get(k) for k in keys}}

    def task_gpus(_):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        yield ctx.resources()["gpu"].addresses

    spark = hvd_spark.local_session("local-cluster[2,1,1024]", conf={
        "spark.executor.memory": "1g",
        "spark.worker.resource.gpu.amount": "1",
        "spark.worker.resource.gpu.discoveryScript": sys.argv[1],
        "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "1",
    })
    spark.sparkContext.setLogLevel("ERROR")
    try:
        out = {
            "assigned": spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task_gpus).collect(),
            "default": hvd_spark.run(rank_env, num_proc=2, verbose=0),
            "user_env": hvd_spark.run(rank_env, num_proc=2, verbose=0, env={"CUDA_VISIBLE_DEVICES": "7"}),
            "cpu": hvd_spark.run(rank_env, num_proc=2, verbose=0, use_gpu=False),
        }
        # A fit on the (fake) GPUs, and a transform whose UDF places the model on its task's GPU
        # (tf.device("/GPU:n"); this CPU-only TensorFlow falls back to the CPU).
        import keras, numpy as np, pandas as pd
        from hvd_spark import HorovodEstimator
        rng = np.random.default_rng(0)
        x = rng.uniform(-1, 1, (256, 2)).astype("float32")
        y = (x[:, 0] * x[:, 1] > 0).astype("int64")
        df = spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y})).repartition(2)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        fitted = HorovodEstimator(num_proc=2, store=sys.argv[2], model=model, optimizer="sgd",
                                  loss="binary_crossentropy", feature_cols=["x"], label_cols=["y"], epochs=2,
                                  verbose=0).fit(df)
        one = spark.createDataFrame(pd.DataFrame({"x": list(x)})).coalesce(1)
        got = np.array(fitted.transform(one).select("y__output").toPandas()["y__output"].tolist())
        want = fitted.getModel().predict(x, verbose=0)[:, 0]
        out["fit"] = {"epochs": len(fitted.getHistory()["loss"]),
                      "digests": len({r.weights_digest for r in fitted.getFitSummary().ranks}),
                      "max_diff": float(np.abs(got - want).max())}
        print("RESULT " + json.dumps(out))
    finally:
        spark.stop()
""")


@pytest.mark.slow  # 70 s: two executor JVMs with mocked GPUs; the unit tests of GPU assignment stay in CI
def test_each_rank_gets_exactly_its_tasks_gpu_on_local_cluster(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text(DISCOVERY)
    script.chmod(0o755)
    out = run_result_script(SCRIPT, str(script), str(tmp_path / "store"), cwd=tmp_path)
    assert sorted(a for task in out["assigned"] for a in task) == ["0", "1"]  # one fake GPU per executor
    ranks = out["default"]
    assert all(r["sum"] == [2.0] for r in ranks)  # the ranks trained together
    # Spark's conf asks for GPUs, so use_gpu defaults on: each rank sees exactly its task's GPU.
    assert sorted(r["CUDA_VISIBLE_DEVICES"] for r in ranks) == ["0", "1"]
    assert all(r["HVD_SPARK_GPUS"] == r["CUDA_VISIBLE_DEVICES"] for r in ranks)
    assert all(r["TF_FORCE_GPU_ALLOW_GROWTH"] == "true" for r in ranks)
    assert all(r["HOROVOD_GPU_OPERATIONS"] is None for r in ranks)  # this Horovod has no NCCL
    # The user's CUDA_VISIBLE_DEVICES wins; use_gpu=False hides the tasks' GPUs from TensorFlow.
    assert all(r["CUDA_VISIBLE_DEVICES"] == "7" for r in out["user_env"])
    assert all(r["CUDA_VISIBLE_DEVICES"] == "" and r["HVD_SPARK_GPUS"] is None for r in out["cpu"])
    # The estimator on GPU tasks: both ranks trained the same weights, and transform predicts as Keras does.
    assert out["fit"]["epochs"] == 2 and out["fit"]["digests"] == 1
    assert out["fit"]["max_diff"] < 1e-5
