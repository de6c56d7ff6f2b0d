"""Fits that share a store at the same time: threads, CrossValidator(parallelism=2), other processes.

Real Spark, real Parquet on a local store, real Horovod ranks. What is asserted: every fit
finishes, the same data is written once (one attempt folder per data key), no lease or
half-written folder is left behind, and files a fit reads are never removed under it.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import keras
import numpy as np
import pandas as pd
import pytest

from hvd_spark import HorovodEstimator, Store
from hvd_spark._internal.common import settings
from hvd_spark._internal.common.specs import with_stored_names
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.store import data_path


def _regression_frame(spark, n=240, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype("float32")
    y = 2 * x[:, 0] - x[:, 1] + 0.05 * rng.normal(size=n)
    return spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y.astype("float64")})).repartition(2)


def _linear():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def _linear_estimator(store, **params):
    """An SGD estimator of `_linear` on the regression frame; ``params`` add to / override these."""
    defaults = dict(
        store=store,
        model=_linear(),
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
    )
    return HorovodEstimator(**{**defaults, **params})


def _attempts(store_root):
    """data key -> attempt folders, and every lease / temporary file left under data/."""
    out, leftovers = {}, []
    data_dir = os.path.join(store_root, "data")
    for key in sorted(os.listdir(data_dir)):
        names = os.listdir(os.path.join(data_dir, key))
        out[key] = sorted(n for n in names if n.startswith("a-"))
        leftovers += [n for n in names if n.startswith(("_writing-", "_reading-", ".tmp-"))]
    return out, leftovers


def _prepared(spark, df):
    (features, labels) = with_stored_names(
        [data_mod.column_info(df, "x", "feature")], [data_mod.column_info(df, "y", "label")]
    )
    prepared = data_mod.prepare(df, features, labels, None, 0.25, seed=0)
    return prepared, features + labels  # the columns whose statistics materialize computes


def test_exclusive_publication_has_one_winner(tmp_path):
    store = Store(str(tmp_path))
    wins = []
    go = threading.Event()

    def publish(i):
        go.wait()
        wins.append((i, store.files.create_exclusive_json(store.files.path("k", "meta.json"), {"writer": i})))

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    winners = [i for i, won in wins if won]
    assert len(winners) == 1
    assert store.files.read_json(store.files.path("k", "meta.json")) == {"writer": winners[0]}
    assert store.files.listdir(store.files.path("k")) == ["meta.json"]  # no temporary files left


def test_two_threads_materialize_the_same_data_once(spark, tmp_path):
    prepared, infos = _prepared(spark, _regression_frame(spark))
    store = Store(str(tmp_path))
    metas, errors = [], []

    def run():
        try:
            metas.append(data_mod.materialize(prepared, store, "samekey", infos, 12, 2))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert metas[0]["attempt"] == metas[1]["attempt"]  # the second waited and reused the first
    attempts, leftovers = _attempts(str(tmp_path))
    assert attempts == {"samekey": [metas[0]["attempt"]]} and leftovers == []
    assert sum(r for _, r in metas[0]["train_files"]) == metas[0]["train_rows"]


def test_dead_writer_leftovers_are_removed(spark, tmp_path, caplog):
    """What a driver killed mid-write leaves: an attempt folder without its _complete marker and a lease
    whose heartbeat stopped. The next fit removes both and writes the data itself."""
    prepared, infos = _prepared(spark, _regression_frame(spark))
    store = Store(str(tmp_path))
    folder = data_path(store, "k2")
    dead = os.path.join(folder, "a-20260101000000-deadbeef")
    os.makedirs(os.path.join(dead, "train"))
    open(os.path.join(dead, "train", "part-00000.parquet"), "wb").write(b"half")
    store.files.write_json(
        os.path.join(folder, "_writing-a-20260101000000-deadbeef.json"),
        {"attempt": "a-20260101000000-deadbeef", "heartbeat": time.time() - 3 * settings.LEASE_STALE},
    )
    # A complete attempt that is not published (a replaced one) may still be read: it stays.
    kept = os.path.join(folder, "a-20260101000000-0000cafe")
    os.makedirs(kept)
    open(os.path.join(kept, "_complete"), "wb").close()

    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        meta = data_mod.materialize(prepared, store, "k2", infos, 12, 2)
    assert "waiting for" not in caplog.text and "gave up waiting" not in caplog.text  # a stale lease is no writer
    assert "a-20260101000000-deadbeef, left incomplete by a fit that stopped while writing it" in caplog.text
    attempts, leftovers = _attempts(str(tmp_path))
    assert attempts == {"k2": sorted([meta["attempt"], "a-20260101000000-0000cafe"])} and leftovers == []
    assert store.files.read_json(os.path.join(folder, data_mod.META_NAME))["attempt"] == meta["attempt"]


def test_a_fit_failing_mid_write_leaves_nothing(spark, tmp_path):
    prepared, infos = _prepared(spark, _regression_frame(spark))
    store = Store(str(tmp_path))
    from pyspark.sql import functions as F

    boom = prepared.withColumn("c0", F.when(F.rand(1) < 2, F.raise_error("disk full")).otherwise(F.col("c0")))
    with pytest.raises(Exception, match="disk full"):
        data_mod.materialize(boom, store, "k3", infos, 12, 2)
    assert not os.path.exists(data_path(store, "k3"))


OTHER_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    import hvd_spark
    from hvd_spark import Store
    from hvd_spark._internal.data import materialize as data_mod
    from test_concurrent_fits import _prepared
    spark = hvd_spark.local_session("local[1]", app_name="other-driver")
    df = spark.read.parquet({src!r})
    prepared, infos = _prepared(spark, df)
    open({ready!r}, "w").close()
    while not os.path.exists({go!r}):
        time.sleep(0.05)
    meta = data_mod.materialize(prepared, Store({store!r}), "shared", infos, 12, 2)
    print("META", json.dumps(meta))
    spark.stop()
""")


def test_another_driver_process_materializes_the_same_key(spark, tmp_path):
    src = str(tmp_path / "src")
    _regression_frame(spark).write.parquet(src)
    df = spark.read.parquet(src)
    prepared, infos = _prepared(spark, df)
    store_root = str(tmp_path / "store")
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    script = OTHER_DRIVER.format(tests=os.path.dirname(__file__), src=src, ready=ready, go=go, store=store_root)
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(ready):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the other driver did not start within 180 s"
            time.sleep(0.1)
        open(go, "w").close()
        mine = data_mod.materialize(prepared, Store(store_root), "shared", infos, 12, 2)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    theirs = json.loads([ln for ln in out.splitlines() if ln.startswith("META ")][0][5:])
    assert theirs["attempt"] == mine["attempt"]
    attempts, leftovers = _attempts(store_root)
    assert attempts == {"shared": [mine["attempt"]]} and leftovers == []


def test_two_fits_from_threads_on_one_store(spark, tmp_path):
    df = _regression_frame(spark).cache()
    store = str(tmp_path / "store")
    ests = [_linear_estimator(store, num_proc=2, validation=0.2, epochs=3, run_id=f"thread-{i}") for i in range(2)]
    results, errors = {}, []

    def fit(i):
        try:
            results[i] = ests[i].fit(df)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=fit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert results[0].getFitSummary().data_key == results[1].getFitSummary().data_key
    attempts, leftovers = _attempts(store)
    assert list(attempts.values()) == [attempts[results[0].getFitSummary().data_key]]
    assert len(attempts[results[0].getFitSummary().data_key]) == 1 and leftovers == []
    for i in range(2):
        history = results[i].getHistory()
        assert len(history["loss"]) == 3 and history["loss"][-1] < 0.5 * history["loss"][0]


def test_cross_validator_with_parallelism_two(spark, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    df = _regression_frame(spark, n=320).cache()
    store = str(tmp_path / "store")
    est = _linear_estimator(store, num_proc=1, epochs=4, verbose=0)
    grid = ParamGridBuilder().addGrid(est.batch_size, [8, 32]).build()
    evaluator = RegressionEvaluator(labelCol="y", predictionCol="y__output", metricName="rmse")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, parallelism=2, seed=3)
    cv_model = cv.fit(df)
    y_std = float(np.std(df.select("y").toPandas()["y"]))
    assert len(cv_model.avgMetrics) == 2 and all(m < 0.5 * y_std for m in cv_model.avgMetrics), cv_model.avgMetrics
    rmse = evaluator.evaluate(cv_model.transform(df))
    assert rmse < 0.5 * y_std
    # 2 folds x 2 settings + the final fit: 5 runs. CrossValidator's folds come from rand(): their data has
    # no identity that proves it unchanged, so each fold fit writes its own and removes it at its end;
    # the full data (a cache of local rows: this application's) is kept for reuse.
    assert len(os.listdir(os.path.join(store, "runs"))) == 5
    attempts, leftovers = _attempts(store)
    assert len(attempts) == 1 and all(len(a) == 1 for a in attempts.values()) and leftovers == []


def test_one_writer_per_run_and_a_dead_fits_lease_expires(spark, tmp_path):
    """Two fits of one run_id at once: the second is refused before any work, naming the run and the
    holder, and the first trains every epoch. A lease left by a fit that died (its heartbeat stopped)
    does not block the run: the next fit takes it over and resumes."""
    import socket

    from hvd_spark import RunInUseError

    df = _regression_frame(spark).cache()
    store = str(tmp_path / "store")
    lease = os.path.join(store, "runs", "shared", "_writer.json")
    first, errors = {}, []

    def fit_first():
        try:
            first["model"] = _linear_estimator(store, num_proc=2, epochs=4, run_id="shared").fit(df)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=fit_first)
    thread.start()
    for _ in range(600):
        if os.path.exists(lease) or not thread.is_alive():
            break
        time.sleep(0.1)
    assert os.path.exists(lease), errors
    with pytest.raises(RunInUseError, match=r"run_id 'shared' .* is being trained by another fit right now") as err:
        _linear_estimator(store, num_proc=2, epochs=6, run_id="shared").fit(df)
    assert err.value.run_id == "shared"
    assert err.value.holder["pid"] == os.getpid() and err.value.holder["host"] == socket.gethostname()
    assert f"pid {os.getpid()}" in str(err.value)
    thread.join(600)
    assert not errors, errors
    assert len(first["model"].getHistory()["loss"]) == 4  # undisturbed: every epoch
    assert not os.path.exists(lease)  # released at the end

    # A driver killed mid-fit leaves its lease; once its heartbeat is older than the expiry, the run resumes.
    old = time.time() - settings.LEASE_STALE - 5
    with open(lease, "w") as f:
        json.dump({"host": "gone-host", "pid": 1, "started": old, "heartbeat": old, "token": "dead"}, f)
    resumed = _linear_estimator(store, num_proc=2, epochs=5, run_id="shared").fit(df)
    assert len(resumed.getHistory()["loss"]) == 5  # epochs 1-4 from the checkpoints, 5 trained now
    assert not os.path.exists(lease)
