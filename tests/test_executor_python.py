"""The executors' Python (issue 47.3): one that cannot run hvd_spark is a one-line ExecutorPythonError
before a fit writes anything, and for ``hvd_spark.run``; a session hvd_spark starts itself gives its
Python workers this interpreter.

Spark reads ``PYSPARK_PYTHON`` when the SparkContext starts, so each case runs an application of its
own (a fresh Python, ``run_result_script``) whose workers get a Python made here without any package
(``python -m venv --without-pip``): it finds hvd_spark's sources through ``PYTHONPATH`` but not what
they import (cloudpickle, numpy)."""

import os
import subprocess
import sys

import pytest
from _helpers import run_result_script

APP = """
import json, os, sys, time
import hvd_spark

mode, store = sys.argv[1], sys.argv[2]
if mode != "run-no-session":
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("OFF")
result, began = {}, time.monotonic()
try:
    if mode == "fit":
        import keras

        df = spark.createDataFrame([([float(i % 5), 1.0], i % 2) for i in range(64)], "x array<float>, y long")
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid")])
        began = time.monotonic()
        hvd_spark.HorovodEstimator(
            num_proc=2, store=store, model=model, optimizer="sgd", loss="binary_crossentropy",
            feature_cols=["x"], label_cols=["y"], batch_size=8, epochs=1, verbose=0,
        ).fit(df)
    else:
        result["value"] = hvd_spark.run(os.getpid, num_proc=2, verbose=0)
except Exception as e:
    result.update(type=type(e).__name__, message=str(e), python=getattr(e, "python", None))
result["seconds"] = round(time.monotonic() - began, 2)
result["files"] = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A Python without hvd_spark's packages (a venv of the base interpreter, no pip)."""
    folder = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True, timeout=120)
    python = str(folder / "venv" / "bin" / "python")
    assert subprocess.run([python, "-c", "import cloudpickle"], capture_output=True).returncode != 0
    return python


def _app(tmp_path, mode: str, env: dict) -> dict:
    return run_result_script(APP, mode, str(tmp_path / "store"), cwd=str(tmp_path), env=env, timeout=400)


def _env(**extra) -> dict:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", HVD_SPARK_WARM="1", **extra)
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return env


@pytest.mark.parametrize("mode", ["fit", "run"])
def test_an_executor_python_without_hvd_spark_fails_in_one_line_before_any_data(tmp_path, bare_python, mode):
    out = _app(tmp_path, mode, _env(PYSPARK_PYTHON=bare_python))
    print(
        f"\n{mode}: {out['type']} after {out['seconds']} s, {len(out['files'])} files in the store:\n{out['message']}"
    )
    assert out["type"] == "ExecutorPythonError", out
    assert len(out["message"].splitlines()) == 1
    assert "No module named" in out["message"] and "PYSPARK_PYTHON" in out["message"]
    assert "hvd_spark.local_session()" in out["message"]
    assert out["files"] == [], "the fit wrote to the store before it found the executors' Python wrong"


def test_run_without_a_session_gives_the_workers_this_python(tmp_path, bare_python):
    """No session and no PYSPARK_PYTHON: Spark's default, ``python3`` on the PATH, is a Python without
    hvd_spark here; the session hvd_spark starts gives its workers this interpreter instead."""
    env = _env(PATH=os.path.dirname(bare_python) + os.pathsep + os.environ["PATH"])
    env.pop("PYSPARK_PYTHON", None)
    out = _app(tmp_path, "run-no-session", env)
    assert "type" not in out, out
    assert len(out["value"]) == 2
