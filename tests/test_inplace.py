"""Tables read in place (materialize="auto" / "never"): a Parquet path and a catalog table train the
same model to the same numbers as the copy, what cannot be read in place is refused (or copied) with
its reason before any work, and files changed between or during fits are noticed. Real Spark (the
shared local[2] session), real ranks over Gloo, real Parquet."""

import logging
import os
import sys

import keras
import numpy as np
import pytest
from _helpers import small_model, xor_estimator

from hvd_spark import DataChangedError, Store
from hvd_spark._internal.data import inplace


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _table(spark, path, n=512, seed=0):
    """``n`` xor rows written as Parquet at ``path`` after a shuffle: a Vector ``xv``, the scalars ``a``
    and ``b``, the label ``y`` and ``is_val`` (every 4th row). Returns the rows as numpy."""
    import pandas as pd
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 2))
    y = ((x[:, 0] * x[:, 1]) > 0).astype("int64")
    pdf = pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "y": y, "is_val": (np.arange(n) % 4 == 0)})
    df = spark.createDataFrame(pdf).repartition(3, "y").withColumn("xv", array_to_vector(F.array("a", "b")))
    df.write.mode("overwrite").parquet(str(path))
    return x, y


def _weights(model):
    return [np.asarray(w) for w in model.getModel().get_weights()]


def test_a_parquet_path_a_catalog_table_and_the_copy_train_the_same(spark, tmp_path, caplog):
    """Full-batch steps (one batch of each rank's share), so the gradient is the same sum however the
    rows are ordered: the three fits must agree to float tolerance, validation (a column) included."""
    _table(spark, tmp_path / "t")
    spark.sql("DROP TABLE IF EXISTS inplace_xor")
    spark.read.parquet(str(tmp_path / "t")).write.option("path", str(tmp_path / "tbl")).saveAsTable("inplace_xor")
    model = small_model()
    fits = {}
    for name, frame, mode in [
        ("path", spark.read.parquet(str(tmp_path / "t")).select("xv", "y", "is_val"), "never"),
        ("table", spark.table("inplace_xor"), "never"),
        ("copy", spark.read.parquet(str(tmp_path / "t")), "always"),
    ]:
        store = tmp_path / f"store-{name}"
        est = xor_estimator(
            store,
            model=keras.models.clone_model(model),
            feature_cols=["xv"],
            validation="is_val",
            batch_size=192,  # 384 train rows: one full batch per rank
            epochs=3,
            optimizer=keras.optimizers.SGD(0.5),
            materialize=mode,
            verbose=0,
        )
        est.getModel().set_weights(model.get_weights())
        with caplog.at_level(logging.INFO, logger="hvd_spark"):
            caplog.clear()
            fits[name] = est.fit(frame)
        parquet = [f for _, _, fs in os.walk(store / "data") for f in fs if f.endswith(".parquet")]
        assert bool(parquet) == (mode == "always"), parquet  # nothing copied in place
        said = caplog.text
        assert ("reading the data in place" in said) == (mode == "never"), said
    base = fits["copy"].getHistory()
    assert len(base["loss"]) == 3 and len(base["val_loss"]) == 3
    for name in ("path", "table"):
        np.testing.assert_allclose(fits[name].getHistory()["loss"], base["loss"], rtol=1e-5)
        np.testing.assert_allclose(fits[name].getHistory()["val_loss"], base["val_loss"], rtol=1e-5)
        for w, v in zip(_weights(fits[name]), _weights(fits["copy"])):
            np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert base["loss"][-1] < base["loss"][0]  # it trained


def test_what_cannot_be_read_in_place_is_named(spark, tmp_path):
    from pyspark.sql import functions as F

    _table(spark, tmp_path / "t", n=64)
    src = spark.read.parquet(str(tmp_path / "t"))
    assert inplace.read_plan(src, ["xv", "y"]).scan is not None
    renamed = src.select(F.col("a").alias("left"), F.col("y").cast("double").alias("label"))
    ok = inplace.read_plan(renamed, ["left", "label"])
    assert ok.scan is not None and ok.scan.columns == {"left": "a", "label": "y"}
    cases = {
        "Filter": src.where("y > 0"),
        "computed": src.withColumn("c", F.col("a") * 2),
        "join": src.join(src.select("y").distinct(), "y"),
        "not Parquet": spark.createDataFrame([(1.0, 1)], ["c", "y"]),
    }
    for why, frame in cases.items():
        column = "c" if "c" in frame.columns else "xv"
        decision = inplace.read_plan(frame, [column, "y"])
        assert (
            decision.scan is None
            and why.lower() in decision.reason.lower()
            or (why == "join" and "several sources" in decision.reason)
        ), (why, decision.reason)
    cached = spark.read.parquet(str(tmp_path / "t")).cache()  # from now on src's plans read the cache too
    assert "cached" in inplace.read_plan(cached, ["xv", "y"]).reason
    cached.unpersist()
    partitioned = tmp_path / "p"
    src.write.partitionBy("y").parquet(str(partitioned))
    assert "partition column" in inplace.read_plan(spark.read.parquet(str(partitioned)), ["xv", "y"]).reason

    store = tmp_path / "store"
    with pytest.raises(
        ValueError, match="materialize='never': the DataFrame cannot be read in place because its query has a Filter"
    ):
        xor_estimator(store, feature_cols=["xv"], materialize="never").fit(src.where("y > 0"))
    assert not (store / "data").exists() or not list((store / "data").rglob("*"))  # nothing written


def test_nulls_in_a_table_read_in_place_are_refused_before_training(spark, tmp_path):
    import pandas as pd

    pdf = pd.DataFrame({"a": [0.5, None, 0.1, 0.3], "b": [0.1, 0.2, 0.3, 0.4], "y": [0, 1, 0, 1]})
    spark.createDataFrame(pdf).write.parquet(str(tmp_path / "t"))
    est = xor_estimator(tmp_path / "store", feature_cols=["a", "b"], materialize="never", verbose=0)
    with pytest.raises(
        ValueError, match=r"Feature column '\[a, b\]' has 1 of 4 rows with null, NaN or infinite values"
    ):
        est.fit(spark.read.parquet(str(tmp_path / "t")))


def test_a_table_overwritten_between_fits_is_scanned_again(spark, tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    _table(spark, tmp_path / "t", n=128)
    est = xor_estimator(store, feature_cols=["a", "b"], epochs=1, validation=0.25, verbose=0)
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        est.fit(spark.read.parquet(str(tmp_path / "t")))
        caplog.clear()
        est.fit(spark.read.parquet(str(tmp_path / "t")))  # unchanged: the scan is reused
        assert "reusing the scan" in caplog.text
        _table(spark, tmp_path / "t", n=256, seed=1)  # overwritten: other files
        caplog.clear()
        est.fit(spark.read.parquet(str(tmp_path / "t")))
        assert "reusing the scan" not in caplog.text and "scanned" in caplog.text
    rows = sorted((d["train_rows"] or 0) + (d["val_rows"] or 0) for d in store.datasets())
    assert rows == [128, 256]


class _TouchAfterFirstEpoch(keras.callbacks.Callback):
    """Rank 0 gives a file of the table a new modification time at the end of the fit's first epoch (a
    writer replacing it)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.done = False

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if not self.done and hvd.rank() == 0:
            st = os.stat(self.path)
            os.utime(self.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000_000))
        self.done = True


def test_a_file_changed_during_a_fit_fails_it(spark, tmp_path):
    """The fit resumes a run of one epoch; a file changes during its first epoch. Before: its final model
    stayed in the run, which Store.model_path returned and Store.runs counted."""
    _table(spark, tmp_path / "t", n=128)
    victim = sorted(str(p) for p in (tmp_path / "t").glob("part-*.parquet"))[0]
    store = Store(str(tmp_path / "store"))
    first = xor_estimator(store, feature_cols=["xv"], epochs=1, run_id="changed", verbose=0)
    kept = first.fit(spark.read.parquet(str(tmp_path / "t")))
    est = first.copy({first.epochs: 3, first.callbacks: [_TouchAfterFirstEpoch(victim)]})
    with pytest.raises(
        DataChangedError, match=r"changed while the fit trained on it.*keeps its checkpoints up to epoch 1"
    ):
        est.fit(spark.read.parquet(str(tmp_path / "t")))
    # The rejected fit left no result: the run's newest model is the first fit's, one model, one epoch.
    assert store._url(store.model_path("changed")) == kept.getModelUrl()
    assert [(r["models"], r["epochs"]) for r in store.runs()] == [(1, 1)]
    assert [c.epoch for c in store.checkpoints("changed")] == [1]
    # The run's epoch was trained on the table before the change: it does not go on on the changed one.
    with pytest.raises(ValueError, match=r"files of the table changed in size or modification time: part-"):
        first.copy({first.epochs: 3}).fit(spark.read.parquet(str(tmp_path / "t")))


def _store_state(root) -> dict:
    """Every file in the store, with its size and modification time (a fit's writer lease comes and goes)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_run_goes_on_only_with_its_own_data(spark, tmp_path):
    """A run's data is recorded in its run.json: its files with their identity, read in place, split by
    validation=0.25 and random_seed. The same files resume (on another number of ranks too) and a
    finished run returns its model; the same table copied (which draws other validation rows) and the
    table with a file added are refused before any work. Before: both went on without a word (the
    finished run returned its old model)."""
    path = tmp_path / "t"
    _table(spark, path, n=128)
    store = Store(str(tmp_path / "store"))
    est = xor_estimator(store, feature_cols=["a", "b"], validation=0.25, epochs=1, run_id="own", verbose=0)
    est.fit(spark.read.parquet(str(path)))
    resumed = est.copy({est.epochs: 2, est.num_proc: 1}).fit(spark.read.parquet(str(path)))
    assert len(resumed.getHistory()["val_loss"]) == 2 and len(resumed.getFitSummary().ranks) == 1
    finished = est.copy({est.epochs: 2}).fit(spark.read.parquet(str(path)))
    assert finished.getFitSummary() is None and finished.getModelUrl().endswith("epoch-0002.keras")

    before = _store_state(tmp_path / "store")
    with pytest.raises(
        ValueError,
        match=r"run_id 'own' in .* was trained on other data.*read: the table at \S+ read in place \(\d+ files; "
        r"validation rows drawn by file and row number\) -> a copy in the store \(validation rows drawn by the rows' "
        r"values, because its query has a Filter .*set_weights",
    ):
        est.copy({est.epochs: 3}).fit(spark.read.parquet(str(path)).where("y >= 0"))  # every row, copied
    import pyarrow.parquet as pq

    first = sorted(path.glob("part-*.parquet"))[0]
    pq.write_table(pq.read_table(first), path / "part-added.parquet")
    for epochs in (2, 3):  # finished, resumed
        with pytest.raises(ValueError, match=r"What differs \(run -> this fit\): files of the table added: part-added"):
            est.copy({est.epochs: epochs}).fit(spark.read.parquet(str(path)))
    assert _store_state(tmp_path / "store") == before  # the refused fits wrote nothing
