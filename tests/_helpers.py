"""Helpers shared by test modules (conftest.py files are not importable by name: there are two)."""


def horovod_mpi_built() -> bool:
    try:
        import horovod.tensorflow as hvd

        return bool(hvd.mpi_built())
    except ImportError:
        return False


def xor_frame(spark, n, partitions=2, seed=0):
    """A DataFrame of ``n`` rows: ``x`` (2 floats), the xor label ``y``, ``x0`` and a weight ``w``."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 2)).astype("float32")
    y = ((x[:, 0] * x[:, 1]) > 0).astype("int64")
    pdf = pd.DataFrame({"x": list(x), "y": y, "x0": x[:, 0].astype("float64"), "w": np.ones(n)})
    return spark.createDataFrame(pdf).repartition(partitions)


def small_model():
    import keras

    inputs = keras.Input(shape=(2,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))


def xor_estimator(store, **params):
    """A 2-rank estimator of :func:`small_model` on :func:`xor_frame`; ``params`` override the defaults."""
    from hvd_spark import HorovodEstimator, Store

    defaults = dict(
        num_proc=2,
        store=store if isinstance(store, Store) else str(store),
        optimizer="sgd",
        loss="binary_crossentropy",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
        epochs=2,
    )
    params = {**defaults, **params}
    params.setdefault("model", small_model())
    return HorovodEstimator(**params)
