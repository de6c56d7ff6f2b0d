"""End-to-end overhead: HorovodEstimator.fit wall time with 1 and 2 workers against plain
single-process Keras model.fit on the same rows already in memory (1 intra-op thread, like one
worker), split into materialization, launch + shutdown and training.

    python -m benchmarks.bench_e2e [--quick]
"""

import sys
import tempfile
import time

import cloudpickle
import numpy as np

from benchmarks.common import cli, session, write

# The ranks run in fresh processes that cannot import this folder: ship this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 256
WIDTH = 32


def _model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((WIDTH,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )


def _data(rows):
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, WIDTH)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int64")
    return x, y


def plain_keras(rows):
    """Runs in a fresh rank process with 1 thread: plain model.fit, data generated in memory."""
    import horovod.tensorflow as hvd
    import keras

    hvd.init()
    x, y = _data(rows)
    m = _model()
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
    t0 = time.perf_counter()
    m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=True)
    return time.perf_counter() - t0


def main(quick: bool):
    import keras
    import pandas as pd

    import hvd_spark
    from hvd_spark import HorovodEstimator

    sizes = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    spark = session("local[2]", spark_driver_memory="4g")
    rows_out = []
    try:
        with tempfile.TemporaryDirectory() as store:
            for rows in sizes:
                x, y = _data(rows)
                df = spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y}), "x array<float>, y long")
                df = df.repartition(4).cache()
                df.count()
                baseline = hvd_spark.run(plain_keras, args=(rows,), num_proc=1, num_threads=1, verbose=0)[0]
                entry = {"rows": rows, "plain_keras_fit_s": baseline}
                for n in (1, 2):
                    est = HorovodEstimator(
                        num_proc=n,
                        store=store,
                        model=_model(),
                        optimizer=keras.optimizers.SGD(0.05),
                        loss="binary_crossentropy",
                        feature_cols=["x"],
                        label_cols=["y"],
                        batch_size=BATCH // n,
                        epochs=1,
                        verbose=0,
                        shuffle=False,
                    )
                    t0 = time.perf_counter()
                    summary = est.fit(df).getFitSummary()
                    wall = time.perf_counter() - t0
                    train = max(r.train_seconds or 0.0 for r in summary.ranks)
                    entry[f"fit_{n}w"] = {
                        "wall_s": wall,
                        "materialize_s": summary.materialize_seconds,
                        "launch_and_shutdown_s": summary.train_job_seconds - train,
                        "training_s": train,
                        "checks_s": wall - summary.materialize_seconds - summary.train_job_seconds,
                        "ratio_over_plain": wall / baseline,
                    }
                    print(rows, n, entry[f"fit_{n}w"], flush=True)
                rows_out.append(entry)
                df.unpersist()
    finally:
        spark.stop()
    data = {"batch_global": BATCH, "epochs": 1, "rows": rows_out}
    print(write("e2e_overhead", data))
    return data


if __name__ == "__main__":
    cli(main)
