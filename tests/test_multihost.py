"""Several hosts for real: Spark Workers in network namespaces on a bridge (tests/netns_cluster.py).

Each host has its own network stack and address (10.77.0.2, 10.77.0.3, ...); the Master and the
driver sit on the bridge (10.77.0.1). The hosts share the filesystem (as an NFS mount would), so
the store is a local folder. The driver runs in a fresh process per job (one SparkContext per
process; the suite's shared local session stays untouched). Needs root; skipped with the reason
otherwise.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import netns_cluster  # noqa: E402

pytestmark = pytest.mark.multihost

_OK, _WHY = netns_cluster.can_create_namespaces()
if not _OK:
    pytest.skip(f"multi-host tests need network namespaces: {_WHY}", allow_module_level=True)

PRELUDE = textwrap.dedent("""
    import json, os, socket, sys
    import hvd_spark
    conf = json.loads(sys.argv[1])
    spark = hvd_spark.local_session(conf.pop("master"), conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    def emit(obj):
        print("RESULT " + json.dumps(obj), flush=True)
""")

ALLREDUCE = PRELUDE + textwrap.dedent("""
    def job():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        total = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy().tolist()
        gathered = hvd.allgather(tf.constant([[hvd.rank()]])).numpy().ravel().tolist()
        return {"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
                "cross_size": hvd.cross_size(), "sum": total, "gathered": gathered,
                "host": os.environ["HOROVOD_HOSTNAME"], "hostname": socket.gethostname()}
    try:
        emit(hvd_spark.run(job, num_proc=2, verbose=0, start_timeout=120))
    finally:
        spark.stop()
""")

FIT = PRELUDE + textwrap.dedent("""
    import keras, numpy as np, pandas as pd
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    pdf = pd.DataFrame({"features": list((x / 16.0).astype("float32")), "label": y.astype("int64")})
    df = spark.createDataFrame(pdf).repartition(4)
    train, test = df.randomSplit([0.8, 0.2], seed=1)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=sys.argv[2], model=model, optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=6, verbose=0, start_timeout=120)
    try:
        fitted = est.fit(train)
        out = fitted.transform(test).select("label", "label__output").toPandas()
        acc = float((np.stack(out["label__output"]).argmax(1) == out["label"]).mean())
        summary = fitted.getFitSummary()
        emit({"accuracy": acc, "rows": len(out), "digests": [r.weights_digest for r in summary.ranks],
              "hosts": [r.host for r in summary.ranks]})
    finally:
        spark.stop()
""")


def _drive(cluster, script, *args, timeout=600):
    """Runs a driver script in a fresh process on the bridge; returns what it emitted."""
    conf = dict(cluster.spark_conf(), master=cluster.master_url)
    env = dict(os.environ, SPARK_LOCAL_IP=cluster.driver_ip, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(conf), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module", params=["shared", "own"])
def cluster(request, tmp_path_factory):
    c = netns_cluster.NetnsCluster(
        hosts=2, hostnames=request.param, workdir=str(tmp_path_factory.mktemp(f"netns-{request.param}"))
    )
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_allreduce_across_two_hosts(cluster):
    results = _drive(cluster, ALLREDUCE)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [3.0] and r["gathered"] == [0, 1] for r in results)
    # One rank per host, each host its own: not merged even when both have the same hostname.
    assert sorted(r["host"] for r in results) == ["10.77.0.2", "10.77.0.3"]
    assert all(r["local_size"] == 1 and r["cross_size"] == 2 for r in results)
    if cluster.hostnames == "shared":
        assert results[0]["hostname"] == results[1]["hostname"]
    else:
        assert sorted(r["hostname"] for r in results) == ["hvd-h2", "hvd-h3"]


def test_fit_and_transform_across_two_hosts(cluster, tmp_path):
    if cluster.hostnames != "shared":
        pytest.skip("the fit runs once, on the harder set-up (both hosts share a loopback hostname)")
    out = _drive(cluster, FIT, str(tmp_path / "store"))
    assert sorted(out["hosts"]) == ["10.77.0.2", "10.77.0.3"]
    assert len(set(out["digests"])) == 1  # identical weights on both hosts
    assert out["accuracy"] >= 0.9, out
