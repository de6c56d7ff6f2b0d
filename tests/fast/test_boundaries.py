"""The rules between layers, checked in fresh interpreters: the driver's launcher and the store
load no Keras or TensorFlow (nor Spark ML), the rank side loads no pyspark, and the package root
loads none of them. A new top-level import that breaks a rule fails here."""

import subprocess
import sys

import pytest

HEAVY = ("tensorflow", "keras", "horovod", "pyspark", "pyspark.ml", "petastorm")

CASES = [
    # module, modules it must not load
    ("hvd_spark", HEAVY),
    ("hvd_spark.errors", HEAVY),
    ("hvd_spark._internal.launcher", ("tensorflow", "keras", "horovod", "pyspark.ml", "petastorm")),
    ("hvd_spark._internal.store", HEAVY),
    ("hvd_spark._internal.specs", HEAVY),
    ("hvd_spark._internal.contracts", HEAVY),
    ("hvd_spark._internal.outcomes", HEAVY),
    ("hvd_spark._internal.restarts", HEAVY),
    ("hvd_spark._internal.data", ("tensorflow", "keras", "horovod", "petastorm")),
    ("hvd_spark._internal.driver_service", HEAVY),
    ("hvd_spark._internal.topology", HEAVY),
    ("hvd_spark._internal.progress", HEAVY),
    ("hvd_spark._internal.tracking", HEAVY),  # MLflow (which loads a part of pyspark) only inside functions
    ("hvd_spark._internal.task", ("tensorflow", "keras", "pyspark")),
    ("hvd_spark._internal.child", ("tensorflow", "keras", "pyspark")),
    # the rank side (one interpreter: each of these imports TensorFlow, which takes seconds)
    (
        "hvd_spark._internal.worker, hvd_spark._internal.reader, hvd_spark._internal.keras_hvd, hvd_spark.keras",
        ("pyspark",),
    ),
]


@pytest.mark.parametrize("module,forbidden", CASES, ids=[c[0] for c in CASES])
def test_import_loads_nothing_forbidden(module, forbidden):
    code = f"import sys, {module}\nprint(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.split()}"
