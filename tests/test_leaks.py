"""No leaks: 20 fits and 20 ``run`` calls (some failing) in one SparkSession leave no rank process,
no hvd_spark thread, file descriptor, listening socket or temporary folder behind.

Measured after a warm-up of the same calls, so that what Spark and the warm servers keep on purpose
(Python workers, one warm server per environment) is in the baseline."""

import glob
import os
import sys
import tempfile
import threading

import keras
import numpy as np
import psutil
import pytest
from _helpers import rank_processes  # noqa: E402

import hvd_spark
from hvd_spark import HorovodEstimator

ROUNDS = 20


def _warm_servers() -> list[int]:
    """The servers alone: their forked ranks and inference processes share their command line, not their name."""
    from hvd_spark._internal.infer.remote import INFER_NAME
    from hvd_spark._internal.task.barrier import RANK_NAME

    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "name"])
        if "hvd_spark._internal.task.warm" in " ".join(p.info["cmdline"] or [])
        and p.info["name"] not in (RANK_NAME, INFER_NAME)
    ]


def _state() -> dict:
    me = psutil.Process()
    return {
        "hvd_spark_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("hvd_spark")),
        "fds": len(os.listdir("/proc/self/fd")),
        "listening": sorted(c.laddr.port for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN),
        "tmp": sorted(glob.glob(os.path.join(tempfile.gettempdir(), "hvd_spark-*"))),
        "ranks": rank_processes(),
        "servers": _warm_servers(),
    }


def ok_job():
    import horovod.tensorflow as hvd

    hvd.init()
    return hvd.rank()


def failing_job():
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return hvd.rank()


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _xor(spark):
    import pandas as pd

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(128, 2)).astype("float32")
    y = ((x[:, 0] * x[:, 1]) > 0).astype("int64")
    return spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y})).repartition(2).cache()


def _fit(df, store):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    est = HorovodEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer="sgd",
        loss="mse",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=32,
        epochs=1,
        verbose=0,
    )
    return est.fit(df)


def _calls(spark, df, store, rounds: int) -> None:
    for i in range(rounds):
        assert _fit(df, store).getFitSummary() is not None
        if i % 4 == 3:
            with pytest.raises(hvd_spark.RankFailedError, match="rank 1 fails on purpose"):
                hvd_spark.run(failing_job, num_proc=2, spark=spark, verbose=0)
        else:
            assert hvd_spark.run(ok_job, num_proc=2, spark=spark, verbose=0) == [0, 1]


def test_twenty_fits_and_runs_leave_nothing_behind(spark, tmp_path):
    df = _xor(spark)
    store = str(tmp_path / "store")
    _calls(spark, df, store, 4)  # warm-up: Spark's Python workers, the warm servers
    before = _state()
    _calls(spark, df, store, ROUNDS)
    after = _state()
    assert after["ranks"] == [], "rank processes left behind"
    # No new warm server (one per environment, kept on purpose); one of an earlier test's environment may
    # end meanwhile, idle for HVD_SPARK_WARM_IDLE seconds.
    assert set(after["servers"]) <= set(before["servers"]), "warm servers came (one per environment expected)"
    assert after["hvd_spark_threads"] == before["hvd_spark_threads"]
    assert after["listening"] == before["listening"], "listening sockets left open on the driver"
    assert after["tmp"] == before["tmp"], "temporary folders left behind"
    assert after["fds"] <= before["fds"] + 2, f"file descriptors grew from {before['fds']} to {after['fds']}"
