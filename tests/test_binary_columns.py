"""Binary feature columns (images read with spark.read.format("binaryFile")): a transformation_fn decodes
the bytes on the ranks and in transform; without one the column is refused before any work. Real Spark,
2 ranks on local[2]; PNG images made from scikit-learn's digits (no download)."""

import io
import math
import os
import sys

import numpy as np
import pytest

SIDE = 16  # the digits' 8x8 images, upscaled


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def decode_png(data: bytes) -> np.ndarray:
    """A grey PNG's pixels in [0, 1], shape (SIDE, SIDE): Pillow where installed, else TensorFlow."""
    try:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(data)))
    except ImportError:
        import tensorflow as tf

        pixels = tf.io.decode_png(data, channels=1).numpy()[..., 0]
    return (pixels / 255.0).astype(np.float32)


def decode(frame):
    """The transformation_fn: each image's bytes become a (16, 16) array (the input takes (16, 16, 1))."""
    frame["content"] = [decode_png(b) for b in frame["content"]]
    return frame


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """48 PNG files named <label>_<index>.png: digits upscaled to 16x16 grey images."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    folder = tmp_path_factory.mktemp("pngs")
    x, y = load_digits(return_X_y=True)
    for i in range(48):
        img = np.kron(x[i].reshape(8, 8), np.ones((2, 2))) * (255 / 16)
        png = tf.io.encode_png(img.astype(np.uint8)[..., None]).numpy()
        (folder / f"{y[i]}_{i:03d}.png").write_bytes(png)
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
