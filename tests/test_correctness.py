"""No silent wrong results, with real Spark and 2 Horovod ranks over Gloo: data that changed is
never taken for the old, a run never continues with another model, a fitted model never changes under its
user, ranks draw their own random numbers, validation counts every row once, and a run has one writer."""

import json
import os
import sys
import time

import keras
import numpy as np
import pytest

from hvd_spark import HorovodEstimator, JobCancelledError, RunInUseError, Store
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.identity import data_identity

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import cancel_after_first_checkpoint, rank_processes, xor_estimator, xor_frame  # noqa: E402


def _meta(store: str, key: str) -> dict:
    return Store(store).files.read_json(os.path.join(store, "data", key, data_mod.META_NAME))


def _rows(store: str, model) -> int:
    meta = _meta(store, model.getFitSummary().data_key)
    return meta["train_rows"] + meta["val_rows"]


def test_an_overwritten_parquet_path_is_written_again(spark, tmp_path):
    """Before: the materialization key was the plan's semanticHash, which an overwrite does not change:
    the second fit trained on the first fit's 600 rows instead of 1,500."""
    src, store = str(tmp_path / "src"), str(tmp_path / "store")
    xor_frame(spark, 600).write.parquet(src)
    est = xor_estimator(store, epochs=1, validation=0.2, materialize="always")  # the copy (test_inplace: in place)
    first = est.fit(spark.read.parquet(src))
    assert _rows(store, first) == 600
    again = est.fit(spark.read.parquet(src))  # unchanged: reused
    assert again.getFitSummary().data_key == first.getFitSummary().data_key
    xor_frame(spark, 1500, seed=1).write.mode("overwrite").parquet(src)
    changed = est.fit(spark.read.parquet(src))
    assert changed.getFitSummary().data_key != first.getFitSummary().data_key
    assert _rows(store, changed) == 1500


def test_an_overwritten_table_has_another_identity(spark, tmp_path):
    name = f"t_{os.getpid()}"
    try:
        xor_frame(spark, 600).write.mode("overwrite").saveAsTable(name)
        before = data_identity(spark.table(name))
        assert before.established and before.files >= 1, before
        assert data_identity(spark.table(name)) == before  # unchanged: the same identity
        xor_frame(spark, 1500, seed=1).write.mode("overwrite").saveAsTable(name)
        after = data_identity(spark.table(name))
        assert after.established and after.digest != before.digest
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {name}")


def test_identity_of_other_sources(spark):
    from pyspark.sql import functions as F

    local = spark.createDataFrame([(1.0, 0), (2.0, 1)], "x double, y int")
    assert data_identity(local).established  # local rows: in the plan, or an RDD of this application
    other = spark.createDataFrame([(1.0, 0), (3.0, 1)], "x double, y int")
    assert data_identity(other).digest != data_identity(local).digest
    sampled = spark.range(100).withColumn("r", F.rand(1))
    ident = data_identity(sampled)
    assert not ident.established and "rand" in ident.reason
    assert data_identity(sampled).digest != ident.digest  # never reused
    assert data_identity(sampled, "always").established
    assert not data_identity(local, "never").established
    dated = spark.range(10).withColumn("age", F.datediff(F.current_date(), F.lit("2020-01-01")))
    assert not data_identity(dated).established  # the optimizer folds current_date() to a literal


def test_a_cache_over_files_is_not_taken_for_unchanged_data(spark, tmp_path):
    """A cached DataFrame over files keeps the data of when it was filled; the plan and inputFiles()
    do not show it, so its data is written anew for each fit (and a cache of local data is this
    application's)."""
    src = str(tmp_path / "src")
    xor_frame(spark, 60).write.parquet(src)
    cached = spark.read.parquet(src).cache()
    try:
        cached.count()
        ident = data_identity(cached)
        assert not ident.established and "cached" in ident.reason, ident
        same_plan = data_identity(spark.read.parquet(src))  # Spark substitutes the cache here too
        assert not same_plan.established, same_plan
    finally:
        cached.unpersist()
    local = xor_frame(spark, 60).cache()
    try:
        local.count()
        assert data_identity(local).established
    finally:
        local.unpersist()


def _relu_model(activation="relu", rate=None):
    inputs = keras.Input(shape=(2,))
    h = keras.layers.Dense(8, activation=activation)(inputs)
    if rate is not None:
        h = keras.layers.Dropout(rate)(h)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))


def test_a_run_refuses_an_edited_model(spark, tmp_path):
    """Before: the fingerprint was layer types and weight shapes, so relu -> tanh resumed the relu run."""
    store = str(tmp_path / "store")
    df = xor_frame(spark, 200)
    xor_estimator(store, epochs=1, run_id="edit", model=_relu_model("relu", 0.5)).fit(df)
    with pytest.raises(ValueError, match=r"activation: 'relu' -> 'tanh'.*new run_id") as e:
        xor_estimator(store, epochs=2, run_id="edit", model=_relu_model("tanh", 0.5)).fit(df)
    assert "set_weights" in str(e.value)  # how to warm-start from the old weights
    with pytest.raises(ValueError, match=r"\(Dropout\)\.rate: 0\.5 -> 0\.2"):
        xor_estimator(store, epochs=2, run_id="edit", model=_relu_model("relu", 0.2)).fit(df)
    with pytest.raises(ValueError, match=r"optimizer: 'SGD' -> 'Adam'"):
        xor_estimator(store, epochs=2, run_id="edit", model=_relu_model("relu", 0.5), optimizer="adam").fit(df)
    assert [c.epoch for c in Store(store).checkpoints("edit")] == [1]  # nothing was trained
    resumed = xor_estimator(store, epochs=2, run_id="edit", model=_relu_model("relu", 0.5)).fit(df)
    assert len(resumed.getHistory()["loss"]) == 2  # the same model resumes


def test_a_fitted_transformer_keeps_its_model_after_a_later_fit_of_its_run(spark, tmp_path):
    """Before: every fit of a run wrote runs/<id>/model.keras, which the earlier transformer read."""
    store = str(tmp_path / "store")
    df = xor_frame(spark, 300)
    est = xor_estimator(store, epochs=1, run_id="keep")
    first = est.fit(df)
    before = np.array(first.transform(df).select("y__output").toPandas()["y__output"].to_list())
    later = xor_estimator(store, epochs=3, run_id="keep").fit(df)
    assert later.getModelUrl() != first.getModelUrl()
    after = np.array(first.transform(df).select("y__output").toPandas()["y__output"].to_list())
    np.testing.assert_array_equal(after, before)
    newer = np.array(later.transform(df).select("y__output").toPandas()["y__output"].to_list())
    assert np.abs(newer - before).max() > 1e-4  # the later fit trained further: its own model differs


class _MaskRecorder(keras.callbacks.Callback):
    """Records, per rank and epoch, a Dropout mask and the layer's seed state at the epoch's start."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def on_epoch_begin(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        layer = next(layer for layer in self.model.layers if isinstance(layer, keras.layers.Dropout))
        mask = np.asarray(layer(np.ones((1, 64), "float32"), training=True)) > 0
        np.save(os.path.join(self.folder, f"mask-{hvd.rank()}-{epoch}.npy"), mask)


def test_dropout_masks_differ_across_ranks_and_repeat_with_the_seed(spark, tmp_path):
    """Before: the start-of-training broadcast copied rank 0's seed generators to every rank, so every
    rank drew the same Dropout masks at every step."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    store = str(tmp_path / "store")
    df = xor_frame(spark, 256)
    digests = []
    for attempt in ("a", "b"):
        folder = tmp_path / attempt
        folder.mkdir()
        keras.utils.set_random_seed(5)
        model = xor_estimator(
            store,
            epochs=2,
            model=_relu_model("relu", rate=0.5),
            random_seed=11,
            run_id=f"drop-{attempt}",
            callbacks=[_MaskRecorder(str(folder))],
        ).fit(df)
        digests.append(model.getFitSummary().ranks[0].weights_digest)
        masks = {name: np.load(folder / name) for name in os.listdir(folder)}
        assert set(masks) == {f"mask-{r}-{e}.npy" for r in (0, 1) for e in (0, 1)}
        for epoch in (0, 1):
            assert not np.array_equal(masks[f"mask-0-{epoch}.npy"], masks[f"mask-1-{epoch}.npy"])
        assert not np.array_equal(masks["mask-0-0.npy"], masks["mask-0-1.npy"])  # a new stream each epoch
        if attempt == "b":
            for name, mask in masks.items():
                np.testing.assert_array_equal(mask, np.load(tmp_path / "a" / name))
    assert digests[0] == digests[1]  # the same seed and num_proc: the same weights


def test_validation_metrics_equal_keras_evaluate_of_the_split(spark, tmp_path):
    """Before: each rank's validation stream was endless and shared validation_steps, so with uneven
    shards rows were counted twice or not at all, and ranks' results were averaged unweighted."""
    store = str(tmp_path / "store")
    df = xor_frame(spark, 1003, partitions=3)
    model = xor_estimator(store, epochs=2, validation=0.3, metrics=["accuracy"], val_batch_size=7, run_id="val").fit(df)
    meta = _meta(store, model.getFitSummary().data_key)
    import pyarrow.parquet as pq

    files = [p for p, _ in meta["val_files"]]
    assert len(files) >= 2  # several files, spread over the ranks
    table = pq.ParquetDataset([f.replace("file://", "") for f in files]).read()
    x = np.stack(table.column("c0").to_pylist()).astype("float32")  # stored names: c0 feature, c1 label
    y = np.asarray(table.column("c1").to_pylist(), dtype="float32")
    assert len(y) == meta["val_rows"]
    plain = model.getModel()
    plain.compile(loss="binary_crossentropy", metrics=["accuracy"])
    expected = plain.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    history = model.getHistory()
    assert history["val_loss"][-1] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
    assert history["val_accuracy"][-1] == pytest.approx(expected["accuracy"], abs=1e-6)


def test_class_indices_out_of_range_are_refused_before_training(spark, tmp_path):
    from pyspark.sql import functions as F

    store = str(tmp_path / "store")
    df = xor_frame(spark, 100).withColumn("label", F.when(F.col("y") == 1, 3).otherwise(0))
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    est = HorovodEstimator(
        num_proc=2,
        store=store,
        model=model,
        optimizer="sgd",
        loss="sparse_categorical_crossentropy",
        feature_cols=["x"],
        label_cols=["label"],
        run_id="labels",
    )
    with pytest.raises(ValueError, match=r"label column 'label' .* 3 units.*\[0, 2\].*e\.g\. 3"):
        est.fit(df)
    s = Store(store)
    assert s.files.listdir(s.files.path("data")) == [] and s.checkpoints("labels") == []


def test_a_fit_that_loses_its_run_stops_before_its_next_checkpoint(spark, tmp_path):
    """Another fit takes the run over (as after a lease expiry): this one's rank 0 finds the lease is not
    its own at the next epoch end and the fit fails with RunInUseError, writing nothing more."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    store = str(tmp_path / "store")
    df = xor_frame(spark, 256)
    lease = os.path.join(store, "runs", "taken", "_writer.json")
    est = xor_estimator(store, epochs=6, run_id="taken", callbacks=[_TakeOverAt(lease, epoch=3)])
    with pytest.raises(RunInUseError, match="taken over"):
        est.fit(df)
    assert [c.epoch for c in Store(store).checkpoints("taken")] == [1, 2]
    thief = json.loads(open(lease).read())
    assert thief["pid"] == -1  # the fit did not remove the new holder's lease


class _TakeOverAt(keras.callbacks.Callback):
    """Rank 1 takes the run's lease over after the first step of epoch ``epoch`` (1-based): that step's
    allreduce needs rank 0, which wrote the previous epoch's checkpoint before it."""

    def __init__(self, lease: str, epoch: int):
        super().__init__()
        self.lease, self.epoch, self.current = lease, epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        import horovod.tensorflow as hvd

        if self.current == self.epoch and batch == 0 and hvd.rank() == 1:
            with open(self.lease + ".tmp", "w") as f:
                json.dump({"token": "another", "host": "elsewhere", "pid": -1, "heartbeat": time.time() + 3600}, f)
            os.replace(self.lease + ".tmp", self.lease)


def test_a_cancelled_fit_returns_after_its_ranks_stopped_and_never_overshoots(spark, tmp_path):
    """Before: after cancelAllJobs() fit raised at once and released the run while the ranks wrote more
    checkpoints; a re-fit started right away could return their model with more epochs than asked."""
    store = str(tmp_path / "store")
    df = xor_frame(spark, 2000)
    s = Store(store)
    fit = xor_estimator(store, epochs=400, run_id="cancel", batch_size=8).fit
    errors = cancel_after_first_checkpoint(spark, lambda: fit(df), s, "cancel")
    assert errors and isinstance(errors[0], JobCancelledError), errors
    assert str(errors[0]).splitlines()[0].startswith("the Spark job of HorovodEstimator.fit was cancelled")
    assert rank_processes() == []  # its ranks have stopped before fit returned: nothing writes after it
    epochs = [c.epoch for c in s.checkpoints("cancel")]
    asked = epochs[-1] + 1
    model = xor_estimator(store, epochs=asked, run_id="cancel", batch_size=8).fit(df)
    assert len(model.getHistory()["loss"]) == asked
    assert [c.epoch for c in s.checkpoints("cancel")] == list(range(1, asked + 1))


def test_store_lists_and_cleans_up_data_and_runs(spark, tmp_path):
    store = str(tmp_path / "store")
    df = xor_frame(spark, 200)
    xor_estimator(store, epochs=1, run_id="old").fit(df)
    s = Store(store)
    (data,) = s.datasets()
    assert data["train_rows"] + data["val_rows"] == 200 and not data["in_use"]
    (run,) = s.runs()
    assert run["run_id"] == "old" and run["epochs"] == 1 and run["models"] == 1 and not run["in_use"]
    assert s.cleanup(older_than=3600) == []  # recent: kept
    assert s.cleanup(older_than=0, runs=True, dry_run=True) == [data["url"], run["url"]]
    assert len(s.datasets()) == 1  # a dry run removes nothing
    assert s.cleanup(older_than=0) == [data["url"]] and s.datasets() == [] and len(s.runs()) == 1
    s.remove_run("old")
    assert s.runs() == []
    with pytest.raises(ValueError, match="no run"):
        s.remove_run("old")
