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


_TEMP_FILES_SCRIPT = r"""
import json, os, sys, tempfile, threading, time
sys.path.insert(0, sys.argv[1])
import hvd_spark
from _helpers import xor_estimator, xor_frame

TMP = os.environ["TMPDIR"]
MARKS = sys.argv[2]


def left():
    # What is in the application's TMPDIR, but the warm servers' folder (theirs to keep while they live).
    out = {}
    for root, dirs, files in os.walk(TMP):
        dirs[:] = [d for d in dirs if not d.startswith("hvd_spark-warm-")]
        for f in files:
            out[os.path.relpath(os.path.join(root, f), TMP)] = os.path.getsize(os.path.join(root, f))
    return out


def settled(timeout=30.0):
    # A killed task's folder is removed by its janitor within a few seconds: wait for it, bounded.
    deadline = time.monotonic() + timeout
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    return left()


def busy_rank(fail_rank):
    # Each rank writes 4 MB in its temporary folder (as a checkpoint would), says so, then waits;
    # rank fail_rank fails once both have written (an abort of the other), or none does (a cancel).
    import os, tempfile, time
    rank = int(os.environ["HVD_SPARK_RANK"])
    with open(os.path.join(tempfile.mkdtemp(prefix="ckpt-"), "model.keras"), "wb") as f:
        f.write(os.urandom(4 << 20))
    open(os.path.join(MARKS, f"{fail_rank}-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if rank == fail_rank and len([m for m in os.listdir(MARKS) if m.startswith(f"{fail_rank}-")]) == 2:
            raise ValueError("rank fails on purpose")
        time.sleep(0.2)


spark = hvd_spark.local_session("local[2]", app_name="temp-files", prewarm=False,
                                conf={"spark.local.dir": sys.argv[3]})
spark.sparkContext.setLogLevel("ERROR")
df = xor_frame(spark, 256).cache()
df.count()
result = {"before": left()}
xor_estimator(sys.argv[4], epochs=2, verbose=0).fit(df)
result["fit"] = settled()
try:
    hvd_spark.run(busy_rank, args=(1,), num_proc=2, spark=spark, verbose=0)
except hvd_spark.RankFailedError as e:
    result["aborted"] = str(e).splitlines()[0]
result["abort"] = settled()
errors = []


def cancelled():
    try:
        hvd_spark.run(busy_rank, args=(-1,), num_proc=2, spark=spark, verbose=0)
    except BaseException as e:
        errors.append(type(e).__name__)


thread = threading.Thread(target=cancelled)
thread.start()
deadline = time.monotonic() + 180
while len([m for m in os.listdir(MARKS) if m.startswith("-1-")]) < 2:
    assert time.monotonic() < deadline and thread.is_alive(), "the ranks to cancel did not write their files"
    time.sleep(0.2)
result["written"] = left()
spark.sparkContext.cancelAllJobs()
thread.join(120)
result["cancelled"] = errors
result["cancel"] = settled()
spark.stop()
print("RESULT " + json.dumps(result))
"""


def test_fits_aborted_and_cancelled_runs_leave_no_temporary_files(tmp_path):
    """Before: a fit left 4 files of TensorFlow's autograph in TMPDIR (its ranks' generated modules,
    removed only at an interpreter exit a rank never has); an aborted rank left its temporary folder
    (4 MB here, a checkpoint's stand-in; 49.9 MB for a 4.2M-parameter model); so did a cancelled run's
    ranks and tasks (Spark kills a cancelled task's Python worker: no ``finally`` runs)."""
    from _helpers import run_result_script

    tmp = tmp_path / "tmpdir"
    marks = tmp_path / "marks"
    tmp.mkdir()
    marks.mkdir()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1", TMPDIR=str(tmp))
    args = (tests, str(marks), str(tmp_path / "spark-local"), str(tmp_path / "store"))
    got = run_result_script(_TEMP_FILES_SCRIPT, *args, cwd=str(tmp_path), env=env, timeout=600)
    assert got["before"] == {}
    assert got["fit"] == {}, "a fit left temporary files"
    assert "rank fails on purpose" in got["aborted"]
    assert got["abort"] == {}, "an aborted rank left its temporary folder"
    assert any(f.endswith("model.keras") for f in got["written"]), got["written"]  # the files were there
    assert got["cancelled"] == ["JobCancelledError"]
    assert got["cancel"] == {}, "a cancelled run's ranks left their temporary folders"
