"""Accuracy parity: HorovodEstimator with 2 ranks x 32 rows per step against plain single-process Keras
with batch 64 (the same global batch) and the same number of steps, the same initial weights and the same
optimizer, on scikit-learn's digits, over several seeds, for four models: an MLP, a Dense +
BatchNormalization MLP, a BatchNormalization CNN and a Dropout MLP. Records held-out accuracy per run and
the gap (plain - hvd_spark) per model.

    python -m benchmarks.bench_parity [--quick]
"""

import math
import os
import statistics
import sys
import tempfile

import cloudpickle

from benchmarks.common import cli, session, write

cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

GLOBAL_BATCH = 64
EPOCHS = 4
RANKS = 2


def _model(kind: str):
    import keras

    inputs = keras.Input(shape=(64,), name="pixels")
    if kind == "mlp":
        x = keras.layers.Dense(64, activation="relu")(inputs)
    elif kind == "bn_dense":  # the model of issue 24: Dense + BatchNormalization (Keras' default momentum)
        x = keras.layers.Dense(64, use_bias=False)(inputs)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
    elif kind == "bn_cnn":
        x = keras.layers.Reshape((8, 8, 1))(inputs)
        x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)  # moving statistics that settle in 92 steps
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(64, use_bias=False)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        x = keras.layers.Activation("relu")(x)
    elif kind == "dropout":
        x = keras.layers.Dense(128, activation="relu")(inputs)
        x = keras.layers.Dropout(0.3)(x)
        x = keras.layers.Dense(64, activation="relu")(x)
        x = keras.layers.Dropout(0.3)(x)
    else:
        raise ValueError(kind)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


def _digits(seed: int = 7):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    return train_test_split(X, y.astype("int64"), test_size=0.2, random_state=seed, stratify=y)


def _plain(kind: str, seed: int, x_tr, y_tr, x_te, y_te) -> float:
    """Plain Keras in this process: batch 64, the steps hvd_spark runs, 4 epochs."""
    import keras

    keras.utils.set_random_seed(seed)
    model = _model(kind)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    steps = math.ceil(len(x_tr) / GLOBAL_BATCH)
    model.fit(x_tr, y_tr, batch_size=GLOBAL_BATCH, epochs=EPOCHS, steps_per_epoch=steps, shuffle=True, verbose=0)
    return float(model.evaluate(x_te, y_te, verbose=0, return_dict=True)["accuracy"])


def _distributed(spark, store: str, kind: str, seed: int, train_df, x_te, y_te, ranks: int = RANKS) -> float:
    import keras

    from hvd_spark import HorovodEstimator

    keras.utils.set_random_seed(seed)  # the same initial weights as the plain run
    est = HorovodEstimator(
        num_proc=ranks,
        store=store,
        model=_model(kind),
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["pixels"],
        label_cols=["label"],
        batch_size=GLOBAL_BATCH // ranks,
        epochs=EPOCHS,
        random_seed=seed,
        verbose=0,
    )
    model = est.fit(train_df).getModel()
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return float(model.evaluate(x_te, y_te, verbose=0, return_dict=True)["accuracy"])


def main(quick: bool):
    import pandas as pd

    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    kinds = ["mlp", "bn_dense", "bn_cnn", "dropout"]
    x_tr, x_te, y_tr, y_te = _digits()
    spark = session("local[2]")
    out: dict = {"global_batch": GLOBAL_BATCH, "ranks": RANKS, "epochs": EPOCHS, "seeds": seeds, "models": {}}
    try:
        train_df = spark.createDataFrame(pd.DataFrame({"pixels": list(x_tr), "label": y_tr})).cache()
        train_df.count()
        with tempfile.TemporaryDirectory() as store:
            for kind in kinds:
                runs = []
                for seed in seeds:
                    plain = _plain(kind, seed, x_tr, y_tr, x_te, y_te)
                    dist = _distributed(spark, store, kind, seed, train_df, x_te, y_te)
                    # One rank with the whole batch: hvd_spark's data path without distribution, which
                    # splits a gap into what the data path does and what the second rank does.
                    one = _distributed(spark, store, kind, seed, train_df, x_te, y_te, ranks=1)
                    runs.append(
                        {
                            "seed": seed,
                            "plain_accuracy": plain,
                            "hvd_spark_accuracy": dist,
                            "hvd_spark_1rank_accuracy": one,
                        }
                    )
                    print(kind, seed, f"plain {plain:.4f}  hvd_spark {dist:.4f}  1 rank {one:.4f}", flush=True)
                gaps = [r["plain_accuracy"] - r["hvd_spark_accuracy"] for r in runs]
                out["models"][kind] = {
                    "runs": runs,
                    "plain_mean": statistics.mean(r["plain_accuracy"] for r in runs),
                    "hvd_spark_mean": statistics.mean(r["hvd_spark_accuracy"] for r in runs),
                    "hvd_spark_1rank_mean": statistics.mean(r["hvd_spark_1rank_accuracy"] for r in runs),
                    "gap_mean": statistics.mean(gaps),
                    "gap_max": max(gaps),
                }
    finally:
        spark.stop()
    print(write("parity", out))
    return out


if __name__ == "__main__":
    cli(main)
