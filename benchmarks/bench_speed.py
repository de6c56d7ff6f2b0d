"""The fixed cost of a fit, warm ranks, and cheap steps (issue 13), each against a baseline run
side by side in this script:

1. digits (10 epochs, 2 ranks): a cold fit (no warm server on the machine) against a fresh-process
   plain Keras run of the same model (``python`` start, TF import and fit, timed from outside);
   a second fit with warm ranks, and the same second fit with warm ranks off (fresh processes).
2. 1M rows, 1 epoch: a 1-worker fit (cold: TF import counted, as for the plain run) against a
   fresh-process plain Keras run (data generated in memory); 2 workers against 1, with and
   without gradient accumulation (``backward_passes_per_step``).
3. a 9 KB grouped allreduce (the digits MLP's gradient size class) against Horovod's cycle time.
4. a 12-fit ``TrainValidationSplit`` on digits, warm ranks off (cold) and on (warm).

    python -m benchmarks.bench_speed [--quick]
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import cloudpickle
import numpy as np

from benchmarks.bench_e2e import WIDTH, _data, _model
from benchmarks.common import cli, session, stats, write

cloudpickle.register_pickle_by_value(sys.modules[__name__])
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path.insert(0, EXAMPLES)

DIGITS_EPOCHS = 10
BIG_ROWS, BIG_BATCH = 1_000_000, 256

PLAIN_DIGITS = textwrap.dedent(
    f"""
    import sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {EXAMPLES!r})
    import numpy as np, keras
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from digits import digits_model
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_tr, _, y_tr, _ = train_test_split(X, y, test_size=0.2, random_state=7, stratify=y)
    m = digits_model()
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    m.fit(X_tr.reshape(-1, 8, 8, 1), y_tr, batch_size=32, epochs={DIGITS_EPOCHS}, verbose=0)
    """
)

PLAIN_BIG = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {os.path.dirname(HERE)!r})
    import keras
    from benchmarks.bench_e2e import _data, _model
    x, y = _data({BIG_ROWS})
    m = _model()
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
    m.fit(x, y, batch_size={BIG_BATCH}, epochs=1, verbose=0)
    """
)


def _fresh_process(code: str, threads: int) -> float:
    """Wall seconds of ``python -c code`` (start, imports and work), with ``threads`` TF threads."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env["TF_NUM_INTEROP_THREADS"] = str(threads)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def _kill_warm_servers() -> int:
    """Ends every warm server of this user: the next fit starts cold."""
    import psutil

    killed = 0
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] == ["-m", "hvd_spark._internal.task.warm"] and p.info["uids"].real == os.getuid():
            p.kill()
            killed += 1
    time.sleep(0.5)
    return killed


def _warm(on: bool) -> None:
    os.environ["HVD_SPARK_WARM"] = "1" if on else "0"


def _digits_estimator(store, **over):
    import keras
    from digits import digits_model

    from hvd_spark import HorovodEstimator

    keras.utils.set_random_seed(0)
    params = dict(
        num_proc=2,
        store=store,
        model=digits_model(),
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=DIGITS_EPOCHS,
        verbose=0,
    )
    params.update(over)
    return HorovodEstimator(**params)


def _timed_fit(est, df):
    t0 = time.perf_counter()
    model = est.fit(df)
    return time.perf_counter() - t0, model


def digits_section(spark, repeats: int) -> dict:
    from digits import digits_frames

    train, _ = digits_frames(spark)
    train = train.cache()
    train.count()
    out: dict = {"plain_fresh_process_s": [], "cold_fit_s": [], "warm_second_fit_s": [], "fresh_second_fit_s": []}
    for _ in range(repeats):
        out["plain_fresh_process_s"].append(_fresh_process(PLAIN_DIGITS, threads=2))
        with tempfile.TemporaryDirectory() as store:
            _kill_warm_servers()
            _warm(True)
            out["cold_fit_s"].append(_timed_fit(_digits_estimator(store), train)[0])  # writes the data too
            out["warm_second_fit_s"].append(_timed_fit(_digits_estimator(store), train)[0])
            _warm(False)
            out["fresh_second_fit_s"].append(_timed_fit(_digits_estimator(store), train)[0])
            _warm(True)
        print("digits", {k: round(v[-1], 2) for k, v in out.items()}, flush=True)
    train.unpersist()
    s = {k: stats(v) for k, v in out.items()}
    plain = s["plain_fresh_process_s"]["median"]
    return {
        **s,
        "ratio_cold_over_plain": s["cold_fit_s"]["median"] / plain,
        "ratio_warm_second_over_plain": s["warm_second_fit_s"]["median"] / plain,
        "ratio_fresh_second_over_warm_second": s["fresh_second_fit_s"]["median"] / s["warm_second_fit_s"]["median"],
    }


def _big_frame(spark):
    import pandas as pd

    x, y = _data(BIG_ROWS)
    df = spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y}), "x array<float>, y long").repartition(4)
    return df.cache()


def _big_estimator(store, n: int, passes: int):
    """bench_e2e's model and data, 1 epoch; ``passes``: backward_passes_per_step."""
    import keras

    from hvd_spark import HorovodEstimator

    return HorovodEstimator(
        num_proc=n,
        store=store,
        model=_model(),
        optimizer=keras.optimizers.SGD(0.05),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=BIG_BATCH // n,
        epochs=1,
        verbose=0,
        backward_passes_per_step=passes,
    )


def big_section(spark, repeats: int) -> dict:
    df = _big_frame(spark)
    df.count()
    runs: dict = {"plain_fresh_process_s": [], "cold_1w_s": [], "warm_1w_s": [], "warm_2w_s": [], "warm_2w_acc8_s": []}
    accuracy: dict = {"warm_2w_s": [], "warm_2w_acc8_s": [], "warm_1w_s": []}
    train_s: dict = {k: [] for k in runs if k != "plain_fresh_process_s"}
    for _ in range(repeats):
        runs["plain_fresh_process_s"].append(_fresh_process(PLAIN_BIG, threads=1))
        with tempfile.TemporaryDirectory() as store:
            _kill_warm_servers()
            _warm(True)
            for key, n, passes in (
                ("cold_1w_s", 1, 1),  # writes the data too (later fits reuse it), as a first fit does
                ("warm_1w_s", 1, 1),
                ("warm_2w_s", 2, 1),
                ("warm_2w_acc8_s", 2, 8),
            ):
                wall, model = _timed_fit(_big_estimator(store, n, passes), df)
                runs[key].append(wall)
                summary = model.getFitSummary()
                train_s[key].append(max(r.train_seconds or 0.0 for r in summary.ranks))
                if key in accuracy:
                    accuracy[key].append(model.getHistory()["accuracy"][-1])
        print("1M rows", {k: round(v[-1], 2) for k, v in runs.items()}, flush=True)
    df.unpersist()
    s = {k: stats(v) for k, v in runs.items()}
    med = {k: v["median"] for k, v in s.items()}
    return {
        **s,
        "training_s": {k: stats(v) for k, v in train_s.items()},
        "accuracy": accuracy,
        "ratio_cold_1w_over_plain": med["cold_1w_s"] / med["plain_fresh_process_s"],
        "ratio_warm_1w_over_plain": med["warm_1w_s"] / med["plain_fresh_process_s"],
        "ratio_2w_over_1w": med["warm_2w_s"] / med["warm_1w_s"],
        "ratio_2w_acc8_over_1w": med["warm_2w_acc8_s"] / med["warm_1w_s"],
    }


def allreduce_latency(calls: int):
    """ms per 9.6 KB grouped allreduce (4 tensors) inside a tf.function like a train step's, and ms
    per training step of a small MLP (9 KB of gradients) with those allreduces, on random data."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvd_spark.keras import make_distributed

    hvd.init()
    tensors = [tf.ones([600]) for _ in range(4)]

    @tf.function
    def step():
        return hvd.grouped_allreduce([tf.identity(t) for t in tensors], op=hvd.Average)

    step()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    allreduce_ms = (time.perf_counter() - t0) / calls * 1e3
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=make_distributed(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.random.rand(32 * calls, 64).astype("float32"), np.random.rand(32 * calls, 10).astype("float32")
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0)  # tracing
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return allreduce_ms, (time.perf_counter() - t0) / calls * 1e3


def cycle_section(calls: int) -> list[dict]:
    import hvd_spark

    rows = []
    for cycle in (None, "0.1", "0.5", "2", "5"):
        env = {"HOROVOD_CYCLE_TIME": cycle} if cycle else None
        ms = hvd_spark.run(allreduce_latency, args=(calls,), num_proc=2, env=env, verbose=0)
        rows.append(
            {
                "cycle_time_ms": cycle or "default",
                "ms_per_allreduce": max(m[0] for m in ms),
                "ms_per_train_step": max(m[1] for m in ms),
            }
        )
        print("allreduce", rows[-1], flush=True)
    return rows


def tvs_section(spark, epochs: int) -> dict:
    from digits import digits_frames
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    train, _ = digits_frames(spark)
    train = train.cache()
    train.count()
    out = {}
    for label, on in (("cold", False), ("warm", True)):
        with tempfile.TemporaryDirectory() as store:
            _kill_warm_servers()
            _warm(on)
            est = _digits_estimator(store, epochs=epochs, optimizer=None)
            import keras

            grid = (
                ParamGridBuilder()
                .addGrid(est.optimizer, [keras.optimizers.Adam(1e-3), keras.optimizers.Adam(3e-3)])
                .addGrid(est.batch_size, [16, 32, 64])
                .addGrid(est.shuffle, [True, False])
                .build()
            )
            tvs = TrainValidationSplit(
                estimator=est,
                estimatorParamMaps=grid,
                evaluator=MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy"),
                trainRatio=0.75,
                seed=1,
            )
            t0 = time.perf_counter()
            model = tvs.fit(train)
            wall = time.perf_counter() - t0
            out[label] = {"fits": len(grid) + 1, "wall_s": wall, "best_accuracy": max(model.validationMetrics)}
            print("TVS", label, out[label], flush=True)
    _warm(True)
    train.unpersist()
    out["ratio_cold_over_warm"] = out["cold"]["wall_s"] / out["warm"]["wall_s"]
    return out


def main(quick: bool):
    spark = session("local[2]", spark_driver_memory="4g")
    try:
        data = {
            "digits": digits_section(spark, repeats=2 if quick else 3),
            "allreduce_vs_cycle_time": cycle_section(calls=300 if quick else 1000),
            "million_rows": big_section(spark, repeats=1 if quick else 2),
            "train_validation_split": tvs_section(spark, epochs=2 if quick else 3),
        }
    finally:
        spark.stop()
        _kill_warm_servers()
    data["what"] = (
        f"digits {DIGITS_EPOCHS} epochs on 2 ranks (batch 32 per rank); {BIG_ROWS} rows x {WIDTH} floats, "
        f"1 epoch, global batch {BIG_BATCH}; local[2], one thread per rank"
    )
    print(write("speed", data))
    return data


if __name__ == "__main__":
    cli(main)
