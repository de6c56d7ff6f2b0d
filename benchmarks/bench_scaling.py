"""Scaling: training throughput (samples/s) of a compute-bound CNN with 1 and 2 workers at one
intra-op thread each, and 1 worker with 2 threads; E(2) = X(2 workers) / (2 X(1 worker)).

    python -m benchmarks.bench_scaling [--quick]
"""

import sys
import time

import cloudpickle

from benchmarks.common import cli, session, stats, write

# The ranks run in fresh processes that cannot import this folder: ship this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 64


def throughput_job(steps, epochs):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvd_spark.keras import BroadcastStateCallback, make_distributed

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=make_distributed(keras.optimizers.SGD(0.01)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = tf.random.stateless_normal([BATCH, 32, 32, 3], seed=[hvd.rank(), 0])
    y = tf.zeros([BATCH], tf.int32)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.t)

    model.fit(ds, steps_per_epoch=steps, epochs=epochs + 1, verbose=0, callbacks=[BroadcastStateCallback(), Timer()])
    return [hvd.size() * BATCH * steps / t for t in times[1:]]  # the first epoch (tracing) is left out


def main(quick: bool):
    import hvd_spark

    steps, epochs = (20, 3) if quick else (40, 5)
    spark = session("local[2]")
    try:
        configs = {"1 worker x 1 thread": (1, 1), "2 workers x 1 thread": (2, 1), "1 worker x 2 threads": (1, 2)}
        res = {}
        for name, (n, threads) in configs.items():
            out = hvd_spark.run(throughput_job, args=(steps, epochs), num_proc=n, num_threads=threads, verbose=0)
            res[name] = stats(out[0])
            print(name, res[name]["median"], flush=True)
    finally:
        spark.stop()
    x1, x2 = res["1 worker x 1 thread"]["median"], res["2 workers x 1 thread"]["median"]
    data = {
        "batch_per_worker": BATCH,
        "samples_per_s": res,
        "E2": x2 / (2 * x1),
        "threads_speedup_1w": res["1 worker x 2 threads"]["median"] / x1,
    }
    print(write("scaling", data))
    return data


if __name__ == "__main__":
    cli(main)
