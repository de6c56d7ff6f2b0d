"""Helpers shared by test modules (conftest.py files are not importable by name: there are two)."""

import pytest

# Parameters of features that exist on some Spark lines only: a value carries the marker that
# tests/conftest.py uses to leave it out where the line lacks the feature (see LINE_FEATURES there).
UDF_KINDS = [pytest.param("arrow", marks=pytest.mark.arrow_udf), "pandas"]
READERS = ["arrow", pytest.param("petastorm", marks=pytest.mark.petastorm)]


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


def fit_in_place(spark, store, path, model, features, labels, *, num_proc, batch, epochs, **params):
    """A fit of ``model`` on the Parquet table at ``path`` read in place, unshuffled, validated on its
    ``is_val`` column at ``batch`` rows; checks that every rank ended with the same weights."""
    from hvd_spark import HorovodEstimator

    est = HorovodEstimator(
        num_proc=num_proc,
        store=str(store),
        model=model,
        feature_cols=features,
        label_cols=labels,
        validation="is_val",
        batch_size=batch,
        val_batch_size=batch,
        epochs=epochs,
        shuffle=False,
        materialize="never",
        verbose=0,
        **params,
    )
    fitted = est.fit(spark.read.parquet(path))
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1, fitted.getFitSummary().ranks
    return fitted


def run_result_script(script: str, *args: str, cwd, env=None, timeout: float = 600) -> dict:
    """Runs ``script`` in a fresh Python (a SparkContext per process) with ``args`` and returns the JSON of
    its last ``RESULT `` line; fails the test with its output when it exits non-zero or prints none."""
    import json
    import os
    import subprocess
    import sys

    env = env or dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


def rank_processes() -> list[int]:
    """hvd_spark's rank processes: fresh ones by their command line, warm-forked ones by their name."""
    import psutil

    from hvd_spark._internal.task.barrier import RANK_NAME

    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "hvd_spark._internal.rank.entry" in cmd or p.info["name"] == RANK_NAME:
            found.append(p.pid)
    return found


def cancel_after_first_checkpoint(spark, fit, store, run_id: str, timeout: float = 240) -> list:
    """Runs ``fit()`` on a thread, cancels every Spark job once run ``run_id`` has a checkpoint in
    ``store`` (a ``Store``), waits for ``fit`` to return and gives what it raised. Asserts that it
    returned."""
    import threading
    import time

    errors: list = []

    def target():
        try:
            fit()
        except BaseException as e:  # noqa: BLE001 - the caller checks it
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + timeout
    while not store.checkpoints(run_id):
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.2)
    spark.sparkContext.cancelAllJobs()
    thread.join(120)
    assert not thread.is_alive(), "fit did not return within 120 s of the cancellation"
    return errors
