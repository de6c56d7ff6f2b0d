"""Binary feature columns (images read with spark.read.format("binaryFile")): a transformation_fn decodes
the bytes on the ranks and in transform; without one the column is refused before any work. Real Spark,
2 ranks on local[2]; PNG images made from scikit-learn's digits (no download)."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import images_binaryfile as example  # noqa: E402

SIDE = example.SIDE  # the digits' 8x8 images, upscaled


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    for module in (sys.modules[__name__], example):  # the ranks and transform's workers import neither
        cloudpickle.register_pickle_by_value(module)
    yield
    for module in (sys.modules[__name__], example):
        cloudpickle.unregister_pickle_by_value(module)


decode_png, decode = example.decode_png, example.decode  # the example's transformation_fn


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """48 PNG files named <label>_<index>.png: digits upscaled to 16x16 grey images."""
    folder = tmp_path_factory.mktemp("pngs")
    example.write_pngs(str(folder), limit=48)
    return folder


def image_frame(spark, folder):
    from pyspark.sql import functions as F

    df = spark.read.format("binaryFile").option("pathGlobFilter", "*.png").load(str(folder))
    label = F.regexp_extract("path", r"/(\d)_\d+\.png$", 1).cast("int")
    return df.select("path", "content", label.alias("label"))


def cnn():
    import keras

    inputs = keras.Input(shape=(SIDE, SIDE, 1), name="pixels")
    x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="digit")(x))


def estimator(store, **params):
    import keras

    from hvd_spark import HorovodEstimator

    defaults = dict(
        num_proc=2,
        store=str(store),
        model=cnn(),
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["content"],
        label_cols=["label"],
        batch_size=8,
        epochs=2,
        random_seed=1,
        transformation_fn=decode,
        verbose=0,
    )
    return HorovodEstimator(**{**defaults, **params})


def test_binary_images_train_and_predict_decoded(spark, tmp_path, image_dir):
    from hvd_spark import TFTransformer

    df = image_frame(spark, image_dir)
    fitted = estimator(tmp_path / "store", validation=0.25).fit(df)
    history = fitted.getHistory()
    assert len(history["loss"]) == 2 and "val_loss" in history
    assert all(math.isfinite(v) for values in history.values() for v in values)

    scored = fitted.transform(df).select("path", "label__output").toPandas().sort_values("path")
    assert len(scored) == 48 and scored["label__output"].notna().all()
    files = [p.rsplit("/", 1)[1] for p in scored["path"]]
    images = np.stack([decode_png((image_dir / f).read_bytes()) for f in files])[..., None]
    expected = fitted.getModel().predict(images, verbose=0)
    np.testing.assert_allclose(np.stack(scored["label__output"].to_numpy()), expected, atol=1e-5)
    pandas_udf = fitted.copy().setInferenceUdf("pandas").transform(df).select("path", "label__output")
    by_pandas = pandas_udf.toPandas().sort_values("path")
    np.testing.assert_allclose(np.stack(by_pandas["label__output"].to_numpy()), expected, atol=1e-5)

    saved = str(tmp_path / "saved")
    fitted.save(saved)  # the transformer keeps its transformation_fn
    loaded = TFTransformer.load(saved)
    assert loaded.getTransformationFn() is not None
    again = loaded.transform(df).select("path", "label__output").toPandas().sort_values("path")
    np.testing.assert_allclose(np.stack(again["label__output"].to_numpy()), expected, atol=1e-5)

    bare = fitted.copy().setTransformationFn(None)  # bytes never reach a model undecoded
    with pytest.raises(ValueError, match="Feature column 'content' holds bytes"):
        bare.transform(df)


def test_a_parquet_table_with_a_binary_column_is_read_in_place(spark, tmp_path, image_dir):
    table = str(tmp_path / "table")
    image_frame(spark, image_dir).select("content", "label").write.parquet(table)
    fitted = estimator(tmp_path / "store", epochs=1, materialize="never").fit(spark.read.parquet(table))
    assert all(math.isfinite(v) for values in fitted.getHistory().values() for v in values)


def test_a_binary_column_without_transformation_fn_is_refused_before_work(spark, tmp_path, image_dir):
    store = tmp_path / "store"
    df = image_frame(spark, image_dir)
    with pytest.raises(ValueError, match=r"Feature column 'content' holds bytes .* Received: transformation_fn=None"):
        estimator(store, transformation_fn=None).fit(df)
    assert not store.exists() or not os.listdir(store)  # nothing written
