"""Spark Connect (issue 12, first part): a real local Connect server in its own process
(tests/connect_server.py), this test process only its client. A model fitted on the classic session
is used through Connect: transform (both UDF kinds, streaming), save and load of the transformer and
the estimator, bad input; fit and run refuse Connect clearly, before any work, until the launcher
has a transport that needs no connection back to the client.

These tests run last (tests/conftest.py): a Connect client switches pyspark into Connect mode for
the whole process."""

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.connect

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))


def _probs(df):
    return np.stack(df.sort_values("row")["label__output"].to_numpy())


@pytest.fixture(scope="module")
def classic(spark, tmp_path_factory):
    """A transformer fitted on the classic session, with its predictions there (before Connect mode)."""
    import keras
    from digits import digits_frames, digits_model
    from pyspark.sql import functions as F

    import hvd_spark

    train, test = digits_frames(spark)
    test = test.withColumn("row", F.monotonically_increasing_id())
    keras.utils.set_random_seed(1)
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path_factory.mktemp("store")), model=digits_model(),
        optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=3, verbose=0,
    )  # fmt: skip
    model = est.fit(train)
    rows = test.toPandas()
    expected = model.transform(test).toPandas()
    return est, model, rows, _probs(expected)


@pytest.fixture(scope="module")
def connect(classic, tmp_path_factory):
    pytest.importorskip("grpc", reason="Spark Connect's client needs pyspark[connect]")
    from connect_server import connect_server
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    with connect_server("local[2]", local_dir=str(tmp_path_factory.mktemp("connect-local"))) as url:
        # The Connect builder itself: pyspark's generic builder refuses a remote session while this
        # process also holds the classic one (SESSION_ALREADY_EXIST), which a Connect user never has.
        session = RemoteSparkSession.builder.remote(url).getOrCreate()
        yield session
        session.stop()


@pytest.fixture(autouse=True)
def connect_mode(monkeypatch):
    """What pyspark sets when a process makes a Connect session: pyspark.ml's functions and
    SparkSession.active() then dispatch to Connect. Only for these tests."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")


def _test_frame(connect, rows):
    return connect.createDataFrame(rows[["features", "label", "row"]])


@pytest.mark.parametrize("udf", ["arrow", "pandas"])
def test_transform_through_connect_equals_classic(connect, classic, udf):
    from hvd_spark._internal.sessions import is_connect
    from hvd_spark._internal.transformer import arrow_udfs_available

    if udf == "arrow" and not arrow_udfs_available():
        pytest.skip("Arrow UDFs need pyspark >= 4.1")
    _, model, rows, expected = classic
    df = _test_frame(connect, rows)
    assert is_connect(df.sparkSession)
    out = model.copy({model.inference_udf: udf}).transform(df).toPandas()
    np.testing.assert_allclose(_probs(out), expected, atol=1e-6)
    assert float((out["prediction"] == out["label"]).mean()) >= 0.9  # Spark ML's columns too


def test_streaming_transform_through_connect(connect, classic, tmp_path):
    _, model, rows, expected = classic
    src = str(tmp_path / "in")
    _test_frame(connect, rows).write.parquet(src)
    stream = connect.readStream.schema(connect.read.parquet(src).schema).parquet(src)
    query = model.transform(stream).writeStream.format("memory").queryName("connect_scored")
    query = query.trigger(availableNow=True).start()
    assert query.awaitTermination(240)
    streamed = connect.sql("select * from connect_scored").toPandas()
    np.testing.assert_allclose(_probs(streamed), expected, atol=1e-6)


def test_transformer_and_estimator_save_and_load_through_connect(connect, classic, tmp_path):
    from hvd_spark import HorovodEstimator, TFTransformer

    est, model, rows, expected = classic
    path = str(tmp_path / "transformer")
    model.save(path)
    with pytest.raises(Exception, match="already exists"):
        model.save(path)  # no silent overwrite
    model.write().overwrite().save(path)
    loaded = TFTransformer.load(path)
    np.testing.assert_allclose(_probs(loaded.transform(_test_frame(connect, rows)).toPandas()), expected, atol=1e-6)
    est.save(str(tmp_path / "estimator"))
    again = HorovodEstimator.load(str(tmp_path / "estimator"))
    assert again.getEpochs() == 3 and again.getFeatureCols() == ["features"]
    assert again.getModel().count_params() == est.getModel().count_params()


def test_bad_input_through_connect_names_the_column(connect, classic):
    _, model, rows, _ = classic
    nulls = connect.createDataFrame([([0.5] * 64, 0), (None, 1)], "features array<double>, label long")
    with pytest.raises(Exception, match=r"Feature column 'features' has 1 null values"):
        model.transform(nulls.coalesce(1)).collect()
    assert [r["label"] for r in model.copy({model.handleInvalid: "skip"}).transform(nulls).collect()] == [0]
    scalar = connect.createDataFrame([(0.5, 0)], "features double, label long")
    with pytest.raises(ValueError, match=r"Feature column 'features' holds one value per row"):
        model.transform(scalar)


def test_fit_and_run_refuse_connect_before_any_work(connect, classic, tmp_path):
    import hvd_spark

    est, _, rows, _ = classic
    store = tmp_path / "store"
    with pytest.raises(NotImplementedError, match="HorovodEstimator.fit does not run through Spark Connect yet"):
        est.copy({est.store: str(store)}).fit(_test_frame(connect, rows))
    assert not store.exists()  # nothing written
    with pytest.raises(NotImplementedError, match="does not run through Spark Connect yet"):
        hvd_spark.run(lambda: 1, num_proc=1, spark=connect)
