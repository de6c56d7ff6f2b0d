"""Baseline for issue 28's overhead table: Horovod's own launcher (horovodrun's Python API), no Spark.

Run it with the `horovod-spark` venv of benchmarks/baselines/setup.sh (tf_keras as Keras 2,
Horovod 0.28.1); prints ONE JSON line on stdout at the end, everything else goes to stderr.

    python horovodrun_keras.py [--kill-after-epoch K] [--timeout 180]

`horovod.run(train, np=2, use_gloo=True)` starts 2 local rank processes (the same as
`horovodrun --gloo -np 2`), each runs `train` below: tf.keras (tf_keras, Keras 2) model.fit with
`hvd.DistributedOptimizer` and `hvd.callbacks.BroadcastGlobalVariablesCallback(0)`.

The task (the same in every baseline): sklearn load_digits, all 1,797 rows, X/16 as float32 (64
features), int labels 0-9; MLP 64 -> Dense(64, relu) -> Dense(10, softmax); Adam with learning rate
1e-3, NOT scaled by the number of ranks (Horovod's examples multiply it by hvd.size(); the
baselines all use 1e-3 so they train the same); sparse categorical cross-entropy; 2 ranks, batch 32
per rank, each rank trains on rows rank::2 (899 and 898 rows: 29 steps per epoch on both), 10
epochs, shuffled each epoch; one intra-op and one inter-op thread per rank; CPU only.

Timestamps (time.time(), seconds since the epoch): t_script_start (first line of this file),
t_run_begin (horovod.run called), t_first_step (rank 0, on_train_batch_begin of batch 0 of epoch 0),
t_train_begin / t_train_end (rank 0, on_train_begin / on_train_end of model.fit), t_end (when
horovod.run returned in this process). `accuracy`: rank 0's trained model on all 1,797 rows.
Also: t_rank_proc_start / t_fn_start / t_hvd_init (rank 0's process started, train() entered,
hvd.init() done), t_kill, t_json, error_detail; checks: optimizer_class (horovod._keras.Adam),
weights_max_abs_diff_between_ranks (0.0: gradients were averaged).

--kill-after-epoch K: when epoch K (1-based) has ended, rank 1 SIGKILLs itself (a lost rank; it
first writes t_kill to a file). Recovery Horovod's launcher offers: none by default: the job fails
(launch_gloo raises "one or more processes exited with non-zero status") and rank 0 is terminated.
Elastic Horovod (horovodrun --min-np/--max-np with --host-discovery-script, or horovod.run's
min_np/max_np/host discovery) can go on with fewer ranks, but only with code changes: the training
loop inside `hvd.elastic.run` with a `hvd.elastic.KerasState` committed per epoch/batch. Not used
here. The JSON says outcome "failed" with the error's first line; "hung" when the watchdog
(--timeout) fired first, in which case this script kills its own child processes by pid.
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

# The ranks inherit this environment: one thread each, Keras 2 as tf.keras.
os.environ.update(
    TF_NUM_INTRAOP_THREADS="1",
    TF_NUM_INTEROP_THREADS="1",
    OMP_NUM_THREADS="1",
    TF_CPP_MIN_LOG_LEVEL="2",
    TF_USE_LEGACY_KERAS="1",
    CUDA_VISIBLE_DEVICES="-1",
)

EPOCHS, BATCH, NUM_PROC, LR = 10, 32, 2, 1e-3


def train(work_dir: str, kill_after_epoch):
    """One rank (runs in the processes horovod.run starts; shipped there by cloudpickle)."""
    t_fn_start = time.time()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow.keras as hvd
    from sklearn.datasets import load_digits

    hvd.init()
    t_hvd_init = time.time()
    rank, size = hvd.rank(), hvd.size()
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    Xr, yr = X[rank::size], y[rank::size]

    # Where rank 0's start-up went: process started, train() entered, hvd.init() done.
    times = {"t_rank_proc_start": proc_start_time(), "t_fn_start": t_fn_start, "t_hvd_init": t_hvd_init}

    class TimesCallback(tf.keras.callbacks.Callback):
        epoch = 0

        def on_train_begin(self, logs=None):
            times["t_train_begin"] = time.time()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and self.epoch == 0 and "t_first_step" not in times:
                times["t_first_step"] = time.time()
                if rank == 0:  # kept on disk too, for a run that fails later
                    with open(os.path.join(work_dir, "rank0_times.json"), "w") as f:
                        json.dump(times, f)

        def on_epoch_end(self, epoch, logs=None):
            if kill_after_epoch is not None and epoch + 1 == kill_after_epoch and rank == 1:
                with open(os.path.join(work_dir, "rank1_kill.json"), "w") as f:
                    json.dump({"t_kill": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, logs=None):
            times["t_train_end"] = time.time()

    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    # Learning rate 1e-3, deliberately not multiplied by hvd.size() (the same in every baseline).
    model.compile(
        optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(learning_rate=LR)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(
        Xr,
        yr,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), TimesCallback()],
    )
    # Every rank's final weights, compared by the driver: identical when gradients were averaged.
    np.savez(os.path.join(work_dir, f"weights_rank{rank}.npz"), *model.get_weights())
    opt = type(model.optimizer)
    out = dict(
        times,
        rank=rank,
        steps_per_epoch=int(np.ceil(len(Xr) / BATCH)),
        optimizer_class=f"{opt.__module__}.{opt.__qualname__}",
    )
    if rank == 0:
        out["accuracy"] = float((model.predict(X, batch_size=256, verbose=0).argmax(axis=1) == y).mean())
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill-after-epoch", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=180.0, help="watchdog: outcome 'hung' after this many seconds")
    args = ap.parse_args()
    result = {
        "system": "horovod.run (gloo)",
        "t_script_start": T_SCRIPT_START,
        "kill_after_epoch": args.kill_after_epoch,
        "num_proc": NUM_PROC,
        "epochs": EPOCHS,
        "batch_size_per_rank": BATCH,
    }
    work = tempfile.mkdtemp(prefix="horovodrun_baseline_")
    start_watchdog(args.timeout, result, work)
    try:
        import horovod

        result["versions"] = {"horovod": horovod.__version__}
        result["t_run_begin"] = time.time()
        try:
            per_rank = horovod.run(train, args=(work, args.kill_after_epoch), np=NUM_PROC, use_gloo=True)
        finally:
            result["t_end"] = time.time()
        rank0 = per_rank[0]
        result.update({k: v for k, v in rank0.items() if k != "rank"})
        result.update(compare_rank_weights(work, NUM_PROC))
        result["outcome"] = "finished"
    except Exception as exc:
        result.update(outcome="failed", error=first_line(exc), error_detail=detail(exc))
        result.setdefault("t_end", time.time())
        traceback.print_exc()
        for name in ("rank0_times.json", "rank1_kill.json"):
            path = os.path.join(work, name)
            if os.path.exists(path):
                with open(path) as f:
                    result.update(json.load(f))
    finally:
        from importlib.metadata import version  # no TensorFlow import in the launching process

        result.setdefault("versions", {}).update(
            tensorflow=version("tensorflow-cpu"), tf_keras=version("tf_keras"), numpy=version("numpy")
        )
        shutil.rmtree(work, ignore_errors=True)
        result["t_json"] = time.time()
        emit(result)
    return result


if __name__ == "__main__":
    outcome = main().get("outcome")
    sys.stderr.flush()
    os._exit(0 if outcome == "finished" else 1)
