"""hvd_spark's row of issue 28's overhead table: HorovodEstimator on the shared digits task.

Runs with the project's own venv (``bash scripts/setup.sh``); prints ONE JSON line on stdout at
the end (everything else goes to stderr), with the keys the other baselines print.

    python benchmarks/baselines/hvd_spark_keras.py [--kill-after-epoch K] [--timeout 180]
        [--master local[2]] [--task-cpus 1] [--threads INTRA,INTER] [--epochs 10] [--no-warm-fit]

The task: sklearn load_digits, all 1,797 rows, X/16 as float32 in a DenseVector column (as for
horovod.spark), int labels; MLP 64 -> Dense(64, relu) -> Dense(10, softmax); Adam 1e-3;
2 ranks, batch 32 per rank, 10 epochs; one intra- and one inter-op thread per rank
(``spark.task.cpus=1``) unless ``--threads`` / ``--task-cpus`` say otherwise.

Timestamps (time.time()): t_script_start, t_spark_ready, t_fit_begin / t_fit_end (driver),
t_first_step / t_train_begin / t_train_end (rank 0, from a Keras callback; after a restart, the
first attempt's first step and the last attempt's end), t_predict_begin / t_predict_end (transform
of all rows, prediction column collected); ``epoch_ends`` (rank 0) give the steady step time.
"warm_fit": the same fit + transform again in the same session (warm ranks, a fresh store).

--kill-after-epoch K: rank 1 SIGKILLs itself once, when epoch K has ended. Recovery hvd_spark
offers: ``max_restarts`` (set to 1 here) restarts the ranks from the last checkpoint (one per
epoch), on the same session, with no change to the user's code; ``min_num_proc`` elastic training
(not used here: it needs a cluster whose executors come and go, see bench_elastic.py).
"""

import time

T_SCRIPT_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

from _harness import emit, first_line, start_watchdog  # noqa: E402  (also: stdout is the result line's)

EPOCHS, BATCH, NUM_PROC, LR = 10, 32, 2, 1e-3


def make_callback_class():
    import keras

    class TimesCallback(keras.callbacks.Callback):
        """Rank 0's timestamps into a JSON file; rank 1 kills itself once after epoch K. It never sets
        ``model.stop_training`` and says so: its step hooks would otherwise make the ranks agree on a stop
        after every step (an allreduce each), which the other systems' runs do not pay."""

        may_stop_training = False

        def __init__(self, path, kill_after_epoch=None):
            super().__init__()
            self.path, self.kill_after_epoch = path, kill_after_epoch
            self.times: dict = {}
            self.epoch = 0

        @staticmethod
        def _rank() -> int:
            return int(os.environ.get("HVD_SPARK_RANK", "0"))

        def _save(self) -> None:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.times, f)
            os.replace(self.path + ".tmp", self.path)

        def on_train_begin(self, logs=None):
            if self._rank() != 0:
                return
            if os.path.exists(self.path):  # a restarted attempt: keep the first attempt's first step
                with open(self.path) as f:
                    self.times = json.load(f)
                self.times["t_restart_train_begin"] = time.time()
            else:
                self.times["t_train_begin"] = time.time()
            self.times.setdefault("epoch_ends", [])
            self._save()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self._rank() != 0:
                return
            if batch == 0 and "t_first_step" not in self.times:
                self.times["t_first_step"] = time.time()
                self._save()
            # The step cost: from batch 1 to the last batch's start (whole batches only), without the
            # epoch's own work (checkpoint, metrics, events) that the epoch boundaries include.
            steps = (self.params or {}).get("steps") or 0
            if batch == 1:
                self._t_b1 = time.time()
            elif steps > 2 and batch == steps - 1 and getattr(self, "_t_b1", None) is not None:
                span = (time.time() - self._t_b1) / (steps - 2)
                self.times.setdefault("step_ms_per_epoch", []).append(1000 * span)
                self._t_b1 = None

        def on_epoch_end(self, epoch, logs=None):
            if self._rank() == 0:
                self.times["epoch_ends"].append(time.time())
                self._save()
            marker = os.path.join(os.path.dirname(self.path), "rank1_kill.json")
            if self.kill_after_epoch is not None and epoch + 1 == self.kill_after_epoch and self._rank() == 1:
                if not os.path.exists(marker):  # once: the restarted attempt trains on
                    with open(marker, "w") as f:
                        json.dump({"t_kill": time.time()}, f)
                    os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, logs=None):
            if self._rank() == 0:
                self.times["t_train_end"] = time.time()
                self._save()

    return TimesCallback


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill-after-epoch", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--master", default=f"local[{NUM_PROC}]")
    ap.add_argument("--task-cpus", type=int, default=1)
    ap.add_argument("--threads", default=None, help="INTRA,INTER: TensorFlow's pools in each rank (backend_env)")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--no-warm-fit", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result: dict = {
        "system": "hvd_spark.HorovodEstimator",
        "t_script_start": T_SCRIPT_START,
        "kill_after_epoch": args.kill_after_epoch,
        "num_proc": NUM_PROC,
        "epochs": args.epochs,
        "batch_size_per_rank": BATCH,
        "master": args.master,
        "task_cpus": args.task_cpus,
        "threads": args.threads,
    }
    start_watchdog(args.timeout, result)
    try:
        import keras
        import numpy as np
        from pyspark.ml.linalg import DenseVector
        from sklearn.datasets import load_digits

        import hvd_spark

        TimesCallback = make_callback_class()
        digits = load_digits()
        X = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        spark = hvd_spark.local_session(
            args.master, app_name="baseline-hvd_spark", conf={"spark.task.cpus": str(args.task_cpus)}
        )
        spark.sparkContext.setLogLevel("ERROR")
        result["t_spark_ready"] = time.time()
        df = spark.createDataFrame(
            [(DenseVector(x.astype(np.float64)), int(label)) for x, label in zip(X, y)], ["features", "label"]
        ).cache()
        df.count()
        backend_env = None
        if args.threads:
            intra, inter = args.threads.split(",")
            backend_env = {"TF_NUM_INTRAOP_THREADS": intra, "TF_NUM_INTEROP_THREADS": inter}

        def one_fit(tag: str, out: dict) -> None:
            work = tempfile.mkdtemp(prefix=f"hvd_spark_bench_{tag}_")
            times_path = os.path.join(work, "rank0_times.json")
            inputs = keras.Input(shape=(64,))
            hidden = keras.layers.Dense(64, activation="relu")(inputs)
            model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
            est = hvd_spark.HorovodEstimator(
                num_proc=NUM_PROC,
                store=os.path.join(work, "store"),
                model=model,
                optimizer=keras.optimizers.Adam(LR),
                loss="sparse_categorical_crossentropy",
                metrics=["accuracy"],
                feature_cols=["features"],
                label_cols=["label"],
                batch_size=BATCH,
                epochs=args.epochs,
                verbose=0,
                callbacks=[TimesCallback(times_path, args.kill_after_epoch)],
                max_restarts=1 if args.kill_after_epoch else 0,
                backend_env=backend_env,
            )
            out["t_fit_begin"] = time.time()
            try:
                trained = est.fit(df)
            finally:
                out["t_fit_end"] = out["t_end"] = time.time()
                for path in (times_path, os.path.join(work, "rank1_kill.json")):
                    if os.path.exists(path):
                        with open(path) as f:
                            out.update(json.load(f))
            out["t_predict_begin"] = time.time()
            rows = trained.transform(df).select("label", "prediction").collect()
            out["t_predict_end"] = time.time()
            out["predicted_rows"] = len(rows)
            # A softmax classifier's prediction column holds the class (its probabilities: "probability").
            out["accuracy"] = float(np.mean([int(r.prediction) == r.label for r in rows]))
            summary = trained.getFitSummary()
            out["restarts"] = summary.restarts if summary else None
            out["outcome"] = "finished"

        try:
            one_fit("cold", result)
        except Exception as exc:
            result.update(outcome="failed", error=first_line(exc))
            result.setdefault("t_end", time.time())
            traceback.print_exc()
            return result
        if args.kill_after_epoch is None and not args.no_warm_fit:
            result["warm_fit"] = warm = {}
            try:
                one_fit("warm", warm)
            except Exception as exc:
                warm.update(outcome="failed", error=first_line(exc), t_end=time.time())
                traceback.print_exc()
    except Exception as exc:
        result.update(outcome="failed", error=first_line(exc), t_end=time.time())
        traceback.print_exc()
    finally:
        result["t_json"] = time.time()
        emit(result)
    return result


if __name__ == "__main__":
    outcome = main().get("outcome")
    sys.stderr.flush()
    os._exit(0 if outcome == "finished" else 1)
