"""Images the Spark way: PNG files read with spark.read.format("binaryFile"), decoded by a transformation_fn.

    .venv/bin/python examples/images_binaryfile.py [--num-proc 2] [--epochs 8] [--store ./hvd_spark_store]

Writes scikit-learn's digits (1,797 8x8 images, upscaled to 16x16) as PNG files named
<label>_<index>.png into a temporary folder, reads them with Spark's binaryFile source (a `content`
column of bytes), takes the label from the file name, and fits a small convolutional network with
2 Horovod processes on local Spark. The bytes stay bytes in Spark and in the store; the
transformation_fn decodes them into 16x16 arrays on each rank, and transform() decodes the held-out
images with the same function (the fitted model keeps it) before predicting. Prints the held-out accuracy.
"""

import argparse
import io
import logging
import os
import shutil
import tempfile
import time

SIDE = 16


def decode_png(data: bytes):
    """A grey PNG's pixels in [0, 1] as a (SIDE, SIDE) float32 array (Pillow if installed, else TensorFlow)."""
    import numpy as np

    try:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(data)))
    except ImportError:
        import tensorflow as tf

        pixels = tf.io.decode_png(data, channels=1).numpy()[..., 0]
    return (pixels / 255.0).astype(np.float32)


def decode(frame):
    """The transformation_fn: the `content` column's bytes become pixel arrays (a pandas DataFrame in and out).

    Runs on the ranks for every block of training and validation rows, and in transform() for every
    batch of rows to predict (there the frame holds the feature columns only)."""
    frame["content"] = [decode_png(b) for b in frame["content"]]
    return frame


def write_pngs(folder: str, limit: int | None = None) -> int:
    """The digits (the first ``limit``, or all) as 16x16 grey PNG files named <label>_<index>.png;
    returns how many."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = x[:limit], y[:limit]
    for i, (pixels, label) in enumerate(zip(x, y)):
        img = np.kron(pixels.reshape(8, 8), np.ones((2, 2))) * (255 / 16)  # 8x8 in [0, 16] -> 16x16 bytes
        png = tf.io.encode_png(img.astype(np.uint8)[..., None]).numpy()
        with open(os.path.join(folder, f"{label}_{i:04d}.png"), "wb") as f:
            f.write(png)
    return len(y)


def image_model():
    import keras

    inputs = keras.Input(shape=(SIDE, SIDE, 1), name="pixels")
    x = keras.layers.Conv2D(16, 3, activation="relu", padding="same")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, activation="relu", padding="same")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="digit")(x))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--store", default=os.path.join(os.getcwd(), "hvd_spark_store"))
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("hvd_spark.rank").setLevel(logging.WARNING)  # ranks' own output: only problems

    import keras
    from pyspark.sql import functions as F

    import hvd_spark
    from hvd_spark import HorovodEstimator

    master = a.master
    if master == "local[*]" and (os.cpu_count() or 1) < a.num_proc:
        master = f"local[{a.num_proc}]"
    folder = tempfile.mkdtemp(prefix="hvd_spark-pngs-")
    spark = hvd_spark.local_session(master, app_name="hvd_spark-images")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        n = write_pngs(folder)
        images = spark.read.format("binaryFile").option("pathGlobFilter", "*.png").load(folder)
        label = F.regexp_extract("path", r"/(\d)_\d+\.png$", 1).cast("int")
        images = images.select("path", "content", label.alias("label"))
        held_out = F.abs(F.xxhash64("path")) % 5 == 0  # a fifth of the files, chosen by name
        train_df, test_df = images.where(~held_out), images.where(held_out)
        print(f"{n} PNG files in {folder}; schema: {images.schema.simpleString()}")

        est = HorovodEstimator(
            num_proc=a.num_proc,
            store=a.store,
            model=image_model(),
            optimizer=keras.optimizers.Adam(learning_rate=0.002),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            feature_cols=["content"],  # binary: decoded by transformation_fn
            label_cols=["label"],
            transformation_fn=decode,
            validation=0.1,
            batch_size=a.batch_size,
            epochs=a.epochs,
            random_seed=1,
        )
        t0 = time.time()
        fitted = est.fit(train_df)
        fit_s = time.time() - t0

        t0 = time.time()
        scored = fitted.transform(test_df).select("label", "prediction").toPandas()
        transform_s = time.time() - t0
        accuracy = float((scored["prediction"] == scored["label"]).mean())
        history = fitted.getHistory()
        print(f"{len(history['loss'])} epochs, final val_accuracy {history['val_accuracy'][-1]:.4f}")
        print(f"fit: {fit_s:.1f}s   transform of {len(scored)} images: {transform_s:.1f}s")
        print(f"held-out accuracy: {accuracy:.4f}")
        if accuracy < 0.9:
            raise SystemExit("images example did not reach the expected quality")
    finally:
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
