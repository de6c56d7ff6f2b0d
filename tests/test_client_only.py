"""A Spark Connect user whose environment has only pyspark-client (no JVM, no jars, no Horovod), as on
managed Spark: fit and transform from that environment against a Connect server of the same Spark
version. scripts/setup_client.sh makes the environment (.venv-client: pyspark-client, tensorflow-cpu,
hvd_spark[cpu,connect-client]); the server is tests/connect_server.py started from this test's
interpreter (the default line's .venv), whose Python workers run the Horovod ranks.

This test process only starts things: it never opens a Spark session itself."""

import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.connect, pytest.mark.slow]  # 95 s: builds .venv-client (pyspark-client only)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, "constraints", "spark-4.3.txt")
sys.path.insert(0, os.path.dirname(__file__))


def _default_line_spark() -> str:
    with open(CONSTRAINTS) as f:
        return next(line.split("==")[1].strip() for line in f if line.startswith("pyspark=="))


# The client is built for the default line's Spark version; a server of another version would test a
# mismatch, not the client. The other lines' CI runs list their test files and leave this one out.
if importlib.metadata.version("pyspark") != _default_line_spark():
    pytest.skip(
        f"the pyspark-client environment is made for the default line's Spark {_default_line_spark()}; "
        f"this interpreter has pyspark {importlib.metadata.version('pyspark')}",
        allow_module_level=True,
    )

# What the client environment holds: the distributions and where pyspark comes from.
_INSPECT = """
import importlib.metadata as m, importlib.util, json, os
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
pkg = os.path.dirname(importlib.util.find_spec("pyspark").origin)
import pyspark.sql.connect.session  # the Connect client itself
print(json.dumps({
    "pyspark": version("pyspark"), "pyspark-client": version("pyspark-client"),
    "horovod": version("horovod"), "tensorflow-cpu": version("tensorflow-cpu"), "keras": version("keras"),
    "jars": os.path.exists(os.path.join(pkg, "jars")), "spark-submit": os.path.exists(os.path.join(pkg, "bin")),
    "py4j": importlib.util.find_spec("py4j") is not None,
    "hvd_spark": os.path.dirname(importlib.util.find_spec("hvd_spark").origin),
}))
"""

# The user's program: builds the model, fits on a Connect DataFrame, transforms held-out rows.
_CLIENT = """
import json, sys
import numpy as np, pandas as pd
url, data, store = sys.argv[1:4]
from pyspark.sql import SparkSession
spark = SparkSession.builder.remote(url).getOrCreate()
import keras
import hvd_spark
d = np.load(data)
def frame(X, y):
    return spark.createDataFrame(pd.DataFrame({"features": list(X), "label": y.astype("int64")}))
train, test = frame(d["X_tr"], d["y_tr"]), frame(d["X_te"], d["y_te"])
keras.utils.set_random_seed(1)
inputs = keras.Input(shape=(64,), name="pixels")
x = keras.layers.Dense(64, activation="relu")(inputs)
outputs = keras.layers.Dense(10, activation="softmax", name="digit")(x)
est = hvd_spark.HorovodEstimator(
    num_proc=2, store=store, model=keras.Model(inputs, outputs), optimizer=keras.optimizers.Adam(0.01),
    loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
    label_cols=["label"], batch_size=32, epochs=4, verbose=0,
)
model = est.fit(train)
out = model.transform(test).select("label", "label__output").toPandas()
predicted = np.stack(out["label__output"].to_numpy()).argmax(axis=1)
print("RESULT " + json.dumps({
    "rows": len(out), "accuracy": float((predicted == out["label"].to_numpy()).mean()),
    "epochs": len(model.getHistory()["loss"]), "connect": type(spark).__module__,
}), flush=True)
spark.stop()
"""


@pytest.fixture(scope="module")
def client_python():
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "setup_client.sh")], capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    venv = os.environ.get("HVD_SPARK_CLIENT_VENV", os.path.join(ROOT, ".venv-client"))
    return os.path.join(venv, "bin", "python")


def _script(tmp_path, name: str, code: str) -> str:
    """The client's code as a file: pyspark.sql.connect takes a `python -c` process (no __main__ file)
    for its own doctest run and then looks for a Spark installation, which a client does not have."""
    path = tmp_path / name
    path.write_text(code)
    return str(path)


def _client_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.pop("PYTHONPATH", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def test_client_environment_has_no_jvm_parts(client_python, tmp_path):
    out = subprocess.run(
        [client_python, _script(tmp_path, "what_is_installed.py", _INSPECT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_client_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    spark_version = importlib.metadata.version("pyspark")
    assert found["pyspark"] is None, f"a full pyspark {found['pyspark']} was installed beside pyspark-client"
    assert found["pyspark-client"] == spark_version
    assert (found["jars"], found["spark-submit"], found["py4j"]) == (False, False, False)
    assert found["horovod"] is None
    assert found["tensorflow-cpu"] and found["keras"]
    assert found["hvd_spark"] == os.path.join(ROOT, "hvd_spark")


def test_fit_and_transform_from_a_pyspark_client_only_environment(client_python, tmp_path):
    from connect_server import connect_server
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(
        (X / 16.0).astype(np.float32), y, test_size=0.2, random_state=7, stratify=y
    )
    data = tmp_path / "digits.npz"
    np.savez(data, X_tr=X_tr, y_tr=y_tr, X_te=X_te, y_te=y_te)
    store = tmp_path / "store"
    with connect_server("local[2]", local_dir=str(tmp_path / "server")) as url:
        out = subprocess.run(
            [client_python, _script(tmp_path, "client.py", _CLIENT), url, str(data), str(store)],
            capture_output=True, text=True, timeout=600, env=_client_env(), cwd=str(tmp_path),
        )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"client-only fit and transform: {result}")
    assert result["connect"].startswith("pyspark.sql.connect")
    assert result["rows"] == len(y_te)
    assert result["epochs"] == 4
    assert result["accuracy"] > 0.85, result
