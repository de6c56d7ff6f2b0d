"""The floor of issue 28's overhead table: plain Keras in one fresh process, no launcher.

Runs with the project's venv; prints ONE JSON line on stdout. The same MLP, data and optimizer as
the other baselines; one process sees all 1,797 rows with batch 64 (the global batch of 2 ranks x
32), so it takes the same 29 steps per epoch. ``--threads N``: TensorFlow's intra-/inter-op pools
(default 1, as one rank has). ``--batch 32`` gives one rank's step for the step-cost comparison.

    python benchmarks/baselines/plain_keras.py [--threads 1] [--batch 64] [--epochs 10]
"""

import time

T_SCRIPT_START = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from _harness import emit  # noqa: E402  (also: stdout is the result line's)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    result: dict = {"system": "plain Keras (one process)", "t_script_start": T_SCRIPT_START, "threads": args.threads}
    result["t_imported"] = time.time()
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    times: dict = {"epoch_ends": []}

    class Times(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            times["t_train_begin"] = time.time()

        def on_train_batch_begin(self, batch, logs=None):
            times.setdefault("t_first_step", time.time())
            steps = (self.params or {}).get("steps") or 0  # as in hvd_spark_keras.py: batch 1 to the last
            if batch == 1:
                times["_t_b1"] = time.time()
            elif steps > 2 and batch == steps - 1 and times.get("_t_b1") is not None:
                times.setdefault("step_ms_per_epoch", []).append(
                    1000 * (time.time() - times.pop("_t_b1")) / (steps - 2)
                )

        def on_epoch_end(self, epoch, logs=None):
            times["epoch_ends"].append(time.time())

        def on_train_end(self, logs=None):
            times["t_train_end"] = time.time()

    result["t_fit_begin"] = time.time()
    model.fit(X, y, batch_size=args.batch, epochs=args.epochs, verbose=0, shuffle=True, callbacks=[Times()])
    result["t_fit_end"] = result["t_end"] = time.time()
    result.update(times)
    result["t_predict_begin"] = time.time()
    probs = model.predict(X, batch_size=256, verbose=0)
    result["t_predict_end"] = time.time()
    result["accuracy"] = float((probs.argmax(axis=1) == y).mean())
    result["steps_per_epoch"] = -(-len(X) // args.batch)
    result["outcome"] = "finished"
    emit(result)


if __name__ == "__main__":
    main()
    sys.stderr.flush()
    os._exit(0)
