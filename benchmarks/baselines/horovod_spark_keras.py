"""Baseline for issue 28's overhead table: horovod.spark's KerasEstimator (the legacy stack).

Run it with the `horovod-spark` venv of benchmarks/baselines/setup.sh (pyspark 3.5.9, pyarrow 10,
tf_keras as Keras 2, Horovod 0.28.1); prints ONE JSON line on stdout at the end, everything else
(Spark, TensorFlow, Horovod) goes to stderr.

    python horovod_spark_keras.py [--kill-after-epoch K] [--timeout 180] [--controller gloo|mpi]

The task (the same in every baseline): sklearn load_digits, all 1,797 rows, X/16 as float32 (64
features, a DenseVector column), int labels 0-9; MLP 64 -> Dense(64, relu) -> Dense(10, softmax);
Adam, effective learning rate 1e-3 (no scaling by the number of ranks); sparse categorical
cross-entropy; 2 ranks on local[2], batch 32 per rank, 10 epochs; one intra-op and one inter-op
thread per rank. Each rank reads its own shard of the Parquet copy (Petastorm shards by row group;
Horovod repartitions the data to num_proc partitions, so each rank gets about half the rows) and
runs ceil(1797 / 32 / 2) = 29 steps per epoch.

Differences forced by horovod.spark, on purpose kept visible:
- KerasEstimator multiplies the optimizer's learning rate by hvd.size() in every rank
  (remote.py: `scaled_lr = lr * hvd.size()`); the model is compiled here with 1e-3 / 2 so that the
  learning rate applied is 1e-3, as in the other baselines.
- KerasModel.transform with an integer label column writes `round(prediction[0])` (the rounded
  probability of class 0, not a class: remote predict's scalar branch), so its output column is
  timed but useless as a prediction; `accuracy` is computed from the trained model returned by fit
  (`keras_model.getModel().predict` in the driver) on the same 1,797 rows.
- The Horovod controller is Gloo by default here (`--controller mpi` for mpirun): horovod.spark
  picks MPI by itself when Horovod was built with it, and the other Horovod baseline uses Gloo.

Timestamps (time.time(), seconds since the epoch): t_script_start (first line of this file),
t_spark_ready (session up), t_fit_begin / t_fit_end (driver, around KerasEstimator.fit; t_end is
t_fit_end, when the launcher call returned), t_first_step (rank 0, on_train_batch_begin of batch 0
of epoch 0), t_train_begin / t_train_end (rank 0, on_train_begin / on_train_end of model.fit),
t_predict_begin / t_predict_end (driver, transform of all rows with the output column collected).
"warm_fit" repeats fit + transform in the same Spark session with a fresh store directory.
Also reported: t_rank_proc_start (when rank 0's process started, from /proc), t_json (the line
written), t_kill (rank 1's suicide), error_detail (the whole message on one line); checks:
optimizer_class (horovod._keras.<name> when Horovod wrapped the optimizer), learning_rate_in_rank0
(after the scaling: 1e-3), weights_max_abs_diff_between_ranks (0.0: gradients were averaged).

--kill-after-epoch K: when epoch K (1-based) has ended, rank 1 SIGKILLs itself (a lost rank).
Recovery horovod.spark offers: none. A dead rank fails the whole fit (horovod.spark.run raises);
there is no elastic mode for the estimators (horovod.spark has elastic run_elastic only for
functions, with its own code changes), and no retry: the user reruns fit. The JSON then says
outcome "failed" with the error's first line; "hung" when the watchdog (--timeout) fired first,
in which case this script kills its own child processes (Spark JVM, Python workers, ranks) by pid.
"""

import time

T_SCRIPT_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

from _harness import (  # noqa: E402  (also: stdout is the result line's)
    compare_rank_weights,
    detail,
    emit,
    first_line,
    proc_start_time,
    ship_by_value,
    start_watchdog,
)

ship_by_value()

# ---------------------------------------------------------------------------------------------
# The ranks' environment (horovod.spark passes the driver's os.environ to them): one thread each.
os.environ.update(
    TF_NUM_INTRAOP_THREADS="1",
    TF_NUM_INTEROP_THREADS="1",
    OMP_NUM_THREADS="1",
    TF_CPP_MIN_LOG_LEVEL="2",
    TF_USE_LEGACY_KERAS="1",  # tf.keras is tf_keras (Keras 2): horovod.spark.keras is Keras 2 only
    CUDA_VISIBLE_DEVICES="-1",
    PYSPARK_PYTHON=sys.executable,
    PYSPARK_DRIVER_PYTHON=sys.executable,
    SPARK_LOCAL_IP="127.0.0.1",
    PYARROW_IGNORE_TIMEZONE="1",
)

EPOCHS, BATCH, NUM_PROC, LR = 10, 32, 2, 1e-3


def make_callback_class():
    """The timing / kill callback, built after TF is imported (it subclasses tf.keras's Callback).
    Defined in __main__, so cloudpickle ships the class by value to the ranks."""
    import tensorflow as tf

    class TimesCallback(tf.keras.callbacks.Callback):
        def __init__(self, path, kill_after_epoch=None):
            super().__init__()
            self.path, self.kill_after_epoch = path, kill_after_epoch
            self.times, self.epoch = {}, 0

        def _rank(self):
            import horovod.tensorflow.keras as hvd

            return hvd.rank()

        def _save(self, key):
            if self._rank() != 0:
                return
            self.times[key] = time.time()
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.times, f)
            os.replace(self.path + ".tmp", self.path)

        def on_train_begin(self, logs=None):
            if self._rank() == 0:
                self.times["t_rank_proc_start"] = proc_start_time()
                # A Horovod DistributedOptimizer is a class made in horovod._keras; tf_keras's own
                # Adam here means the ranks do not average their gradients.
                opt = type(self.model.optimizer)
                self.times["optimizer_class"] = f"{opt.__module__}.{opt.__qualname__}"
                # After KerasEstimator's scaling by hvd.size(): expect 1e-3.
                self.times["learning_rate_in_rank0"] = float(
                    tf.keras.backend.get_value(self.model.optimizer.learning_rate)
                )
            self._save("t_train_begin")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and self.epoch == 0 and "t_first_step" not in self.times:
                self._save("t_first_step")

        def on_epoch_end(self, epoch, logs=None):
            if self.kill_after_epoch is not None and epoch + 1 == self.kill_after_epoch and self._rank() == 1:
                with open(os.path.join(os.path.dirname(self.path), "rank1_kill.json"), "w") as f:
                    json.dump({"t_kill": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, logs=None):
            self._save("t_train_end")
            # Every rank's final weights, compared by the driver: identical when gradients were averaged.
            import numpy as np

            np.savez(
                os.path.join(os.path.dirname(self.path), f"weights_rank{self._rank()}.npz"), *self.model.get_weights()
            )

    return TimesCallback


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill-after-epoch", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=180.0, help="watchdog: outcome 'hung' after this many seconds")
    ap.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    ap.add_argument("--no-warm-fit", action="store_true")
    args = ap.parse_args()

    result = {
        "system": "horovod.spark.keras.KerasEstimator",
        "controller": args.controller,
        "t_script_start": T_SCRIPT_START,
        "kill_after_epoch": args.kill_after_epoch,
        "num_proc": NUM_PROC,
        "epochs": EPOCHS,
        "batch_size_per_rank": BATCH,
    }
    base = tempfile.mkdtemp(prefix="hvd_spark_baseline_")  # one folder per fit inside
    start_watchdog(args.timeout, result, base)
    spark = None
    try:
        import horovod
        import horovod.spark
        import numpy as np
        import tensorflow as tf
        from horovod.spark.common.backend import SparkBackend
        from horovod.spark.common.store import LocalStore
        from horovod.spark.keras import KerasEstimator
        from pyspark.ml.linalg import DenseVector
        from pyspark.sql import SparkSession
        from sklearn.datasets import load_digits

        result["versions"] = {
            "horovod": horovod.__version__,
            "tensorflow": tf.__version__,
            "tf_keras": __import__("tf_keras").__version__,
            "pyspark": __import__("pyspark").__version__,
            "pyarrow": __import__("pyarrow").__version__,
            "petastorm": __import__("petastorm").__version__,
            "numpy": np.__version__,
        }
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        TimesCallback = make_callback_class()

        digits = load_digits()
        X = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)

        # The same session settings as hvd_spark.local_session (benchmarks use it): loopback, no UI.
        spark = (
            SparkSession.builder.master(f"local[{NUM_PROC}]")
            .appName("baseline-horovod-spark")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.python.worker.reuse", "true")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        result["t_spark_ready"] = time.time()
        df = spark.createDataFrame(
            [(DenseVector(x.astype(np.float64)), int(label)) for x, label in zip(X, y)], ["features", "label"]
        ).cache()
        df.count()

        def one_fit(tag: str, out: dict) -> None:
            """Fit + transform; fills `out` as it goes, so a failure keeps what was measured."""
            work = tempfile.mkdtemp(prefix=f"{tag}_", dir=base)
            times_path = os.path.join(work, "rank0_times.json")
            model = tf.keras.Sequential(
                [
                    tf.keras.Input(shape=(64,)),
                    tf.keras.layers.Dense(64, activation="relu"),
                    tf.keras.layers.Dense(10, activation="softmax"),
                ]
            )
            estimator = KerasEstimator(
                backend=SparkBackend(
                    num_proc=NUM_PROC,
                    use_gloo=args.controller == "gloo",
                    use_mpi=args.controller == "mpi",
                    verbose=0,
                ),
                store=LocalStore(os.path.join(work, "store")),
                model=model,
                # KerasEstimator scales the learning rate by the number of ranks: 1e-3 / 2 * 2 = 1e-3.
                optimizer=tf.keras.optimizers.Adam(learning_rate=LR / NUM_PROC),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
                feature_cols=["features"],
                label_cols=["label"],
                # Without it the int label is reshaped to the model's output shape (-1, 10) and fails.
                label_shapes=[[-1, 1]],
                batch_size=BATCH,
                epochs=EPOCHS,
                verbose=0,
                callbacks=[TimesCallback(times_path, args.kill_after_epoch)],
            )
            out["t_fit_begin"] = time.time()
            try:
                try:
                    keras_model = estimator.fit(df)
                finally:
                    out["t_fit_end"] = out["t_end"] = time.time()
                    for path in (times_path, os.path.join(work, "rank1_kill.json")):
                        if os.path.exists(path):
                            with open(path) as f:
                                out.update(json.load(f))
                    out.update(compare_rank_weights(work, NUM_PROC))
                out["t_predict_begin"] = time.time()
                predicted = keras_model.transform(df).select("label__output").collect()
                out["t_predict_end"] = time.time()
                out["predicted_rows"] = len(predicted)
                probs = keras_model.getModel().predict(X, batch_size=256, verbose=0)
                out["accuracy"] = float((probs.argmax(axis=1) == y).mean())
                out["outcome"] = "finished"
            finally:
                shutil.rmtree(work, ignore_errors=True)  # the store (Parquet copy, checkpoints, logs)

        try:
            one_fit("cold", result)
        except Exception as exc:  # the fit (or transform) failed: report it
            result.update(outcome="failed", error=first_line(exc), error_detail=detail(exc))
            result.setdefault("t_end", time.time())
            traceback.print_exc()
            return result
        if args.kill_after_epoch is None and not args.no_warm_fit:
            result["warm_fit"] = warm = {}
            try:
                one_fit("warm", warm)
            except Exception as exc:
                warm.update(outcome="failed", error=first_line(exc), error_detail=detail(exc))
                warm.setdefault("t_end", time.time())
                traceback.print_exc()
    except Exception as exc:
        result.update(outcome="failed", error=first_line(exc), error_detail=detail(exc), t_end=time.time())
        traceback.print_exc()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        result["t_json"] = time.time()
        emit(result)
        if spark is not None:
            try:
                spark.stop()
            except Exception:
                traceback.print_exc()
    return result


if __name__ == "__main__":
    outcome = main().get("outcome")
    sys.stderr.flush()
    # Leftover Horovod service threads must not keep the interpreter up.
    os._exit(0 if outcome == "finished" else 1)
