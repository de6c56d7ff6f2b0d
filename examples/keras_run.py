"""Your own Keras 3 training loop on Horovod ranks with hvd_spark.run and hvd_spark.keras.

    .venv/bin/python examples/keras_run.py [--num-proc 2] [--master local[2]] [--epochs 8]

Each rank trains on its own shard of scikit-learn's digits with a distributed optimizer; rank
0's starting weights are broadcast, BatchNormalization statistics agree at every epoch end and
the metrics are averaged. Every rank returns a hash of its weights (they must be identical) and
rank 0 saves the model, which then loads in plain Keras.
"""

import argparse
import logging
import os
import tempfile


def train(epochs: int, path: str):
    import hashlib

    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    import hvd_spark.keras as hk

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")[hvd.rank() :: hvd.size()]  # this rank's shard
    y = y[hvd.rank() :: hvd.size()]
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast makes them equal
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=hk.make_distributed(keras.optimizers.Adam(2e-3 * hvd.size())),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[hk.BroadcastStateCallback(), hk.StateAgreementCallback(), hk.MetricAverageCallback()],
    )
    if hvd.rank() == 0:
        hk.save_model(model, path)
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.weights)).hexdigest()[:16]
    return {"rank": hvd.rank(), "digest": digest, "accuracy": history.history["accuracy"][-1]}


def main():
    import hvd_spark

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--epochs", type=int, default=8)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    spark = hvd_spark.local_session(a.master)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        try:
            results = hvd_spark.run(train, args=(a.epochs, path), num_proc=a.num_proc)
        finally:
            spark.stop()
        for r in results:
            print(f"rank {r['rank']}: weights {r['digest']}, training accuracy (averaged) {r['accuracy']:.3f}")
        assert len({r["digest"] for r in results}) == 1, "ranks ended with different weights"
        import keras

        model = keras.models.load_model(path)
        print(f"saved model loads in plain Keras: {type(model.optimizer).__name__}, {model.count_params()} parameters")


if __name__ == "__main__":
    main()
