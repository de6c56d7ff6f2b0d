"""String columns feeding Keras preprocessing layers (StringLookup, TextVectorization, Hashing): fitted
on the copied and the in-place path and transformed with both UDFs. Real Spark, real ranks."""

import sys

import keras
import numpy as np
import pytest

from hvd_spark import HorovodEstimator


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


COLORS = ["red", "green", "blue", "black"]
WORDS = ["good", "bad", "fine", "poor", "okay"]


def _frame(spark, n=800, seed=0):
    """``color`` (a string), ``text`` (two or three words), ``city`` (a string hashed into bins) and the
    label: 1 when the color is red or the text says "good"."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    color = rng.choice(COLORS, n)
    text = [" ".join(rng.choice(WORDS, rng.integers(2, 4))) for _ in range(n)]
    city = rng.choice(["paris", "oslo", "lima"], n)
    y = ((color == "red") | np.array(["good" in t for t in text])).astype("int64")
    return spark.createDataFrame(pd.DataFrame({"color": color, "text": text, "city": city, "y": y})).repartition(3)


def _model():
    color = keras.Input(shape=(1,), dtype="string", name="color")
    text = keras.Input(shape=(), dtype="string", name="text")
    city = keras.Input(shape=(1,), dtype="string", name="city")
    c = keras.layers.StringLookup(vocabulary=COLORS, output_mode="one_hot")(color)
    t = keras.layers.TextVectorization(vocabulary=WORDS, output_mode="multi_hot")(text)
    h = keras.layers.CategoryEncoding(8, output_mode="one_hot")(keras.layers.Hashing(num_bins=8)(city))
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Concatenate()([c, t, h]))
    return keras.Model([color, text, city], out)


def _accuracy(model, df, **udf) -> float:
    scored = model.setInferenceUdf(**udf).transform(df) if udf else model.transform(df)
    pdf = scored.select("y", "y__output").toPandas()
    return float(((pdf["y__output"] > 0.5).astype(int) == pdf["y"]).mean())


@pytest.mark.parametrize("materialize", ["always", "never"])
def test_a_string_lookup_text_vectorization_and_hashing_model_fits_and_transforms(spark, tmp_path, materialize):
    df = _frame(spark)
    if materialize == "never":  # the table's own Parquet files, read in place
        df.write.parquet(str(tmp_path / "t"))
        df = spark.read.parquet(str(tmp_path / "t"))
    est = HorovodEstimator(
        num_proc=2,
        store=str(tmp_path / "store"),
        model=_model(),
        optimizer=keras.optimizers.Adam(0.05),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        feature_cols=["color", "text", "city"],
        label_cols=["y"],
        validation=0.2,
        batch_size=32,
        epochs=8,
        materialize=materialize,
        verbose=0,
    )
    model = est.fit(df)
    assert model.getHistory()["val_accuracy"][-1] > 0.9
    assert _accuracy(model, df) > 0.9
    assert abs(_accuracy(model, df, value="pandas") - _accuracy(model, df)) < 1e-9
    holes = spark.createDataFrame(
        [("red", "good day", None, 1), (None, "bad", "oslo", 0)], "color string, text string, city string, y long"
    )
    for udf in ("arrow", "pandas"):
        kept = model.setInferenceUdf(udf).setHandleInvalid("keep").transform(holes).toPandas()["y__output"]
        assert kept.isna().all(), (udf, kept)  # a null string: a null prediction


def test_string_columns_and_numeric_inputs_must_match(spark, tmp_path):
    df = _frame(spark, n=16)
    numeric = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    est = HorovodEstimator(
        num_proc=2,
        store=str(tmp_path / "s"),
        model=numeric,
        optimizer="sgd",
        loss="mse",
        feature_cols=["color"],
        label_cols=["y"],
    )
    with pytest.raises(ValueError, match="Feature column 'color' holds strings; model input .* takes float32"):
        est.fit(df)
    with pytest.raises(ValueError, match="takes strings .dtype 'string'.; feature column 'y' holds bigint"):
        est.setModel(_model()).setFeatureCols(["color", "text", "y"]).fit(df)
