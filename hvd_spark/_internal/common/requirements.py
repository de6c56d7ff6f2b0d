"""The optional pieces hvd_spark needs where it runs, and the error that names the extra to install;
and the executors' Python: which failures of a Spark job say it cannot run hvd_spark, and what the
executors' check (``driver/prewarm.py``) answers.

A bare ``pip install hvd_spark`` brings neither Spark nor TensorFlow (pyproject.toml explains why):
the user picks ``spark`` or ``connect-client`` and ``cpu`` or ``gpu``, or uses the ones a managed
runtime provides. The checks look the packages up without importing them (``find_spec`` of a
top-level name loads nothing), so they cost nothing where the packages are there.
"""

import importlib.util
import json
import re

from hvd_spark.errors import ExecutorPythonError

SPARK_EXTRAS = (
    "pip install 'hvd_spark[spark]' (the full pyspark: local Spark, clusters, a local Connect server) or "
    "pip install 'hvd_spark[connect-client]' (only the Spark Connect client, for a remote Connect server); "
    "on a runtime that provides its own pyspark (Databricks and the like) run hvd_spark there, with neither"
)
TENSORFLOW_EXTRAS = (
    "pip install 'hvd_spark[cpu]' (tensorflow-cpu) or pip install 'hvd_spark[gpu]' (tensorflow[and-cuda]); "
    "on a runtime that provides its own TensorFlow 2.21, with neither"
)


def installed(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def missing_message(what: str, *, spark: bool = False, tensorflow: bool = False) -> str | None:
    """The message for the first missing piece of those asked for, or None when all are installed.

    Args:
        what: what needs them, for the message (e.g. ``"HorovodEstimator"``).
        spark: pyspark (full or the Connect client) is needed.
        tensorflow: TensorFlow and Keras are needed (the driver builds and saves the Keras model).
    """
    if spark and not installed("pyspark"):
        return f"{what} needs pyspark, which is not installed. Install it with {SPARK_EXTRAS}."
    if tensorflow and not (installed("tensorflow") and installed("keras")):
        gone = "TensorFlow" if not installed("tensorflow") else "Keras"
        return f"{what} needs TensorFlow with Keras 3; {gone} is not installed. Install one with {TENSORFLOW_EXTRAS}."
    return None


def require(what: str, *, spark: bool = False, tensorflow: bool = False) -> None:
    """Raises ModuleNotFoundError naming the hvd_spark extra to install when a needed piece is missing.

    Raises:
        ModuleNotFoundError: pyspark, TensorFlow or Keras is asked for and not installed.
    """
    message = missing_message(what, spark=spark, tensorflow=tensorflow)
    if message is not None:
        raise ModuleNotFoundError(message)


# What a Spark job's error says when the executors' Python cannot run hvd_spark: an import that
# failed there (hvd_spark, or what it needs), an interpreter that does not exist, another Python.
_EXECUTOR_PYTHON = re.compile(
    # hvd_spark's modules or those it and Spark's Python worker need, missing or of another version; a
    # missing module of the user's own code is the user's error, not the Python's (and may be restarted)
    r"(?:ModuleNotFoundError|ImportError): (?:No module named|cannot import name [^\n]*? from) "
    r"'(?:hvd_spark|pyspark|py4j|cloudpickle|numpy|pandas|pyarrow|psutil|fsspec)(?:\.[^'\n]*)?'[^\n]*"
    r"|Cannot run program \"[^\"]*\"[^\n]*"
    r"|Python in worker has different version[^\n]*"
)


def executor_python_problem(text: str) -> str | None:
    """The line of a failed Spark job's error that says the executors' Python cannot run hvd_spark
    (``"ModuleNotFoundError: No module named 'hvd_spark'"``), or None when it says nothing of the kind."""
    found = _EXECUTOR_PYTHON.findall(text or "")
    return found[-1].strip().rstrip(".")[:300] if found else None


def executors_check(answers: list[str], driver_version: str) -> ExecutorPythonError | None:
    """The error of the executors' answers (``driver/prewarm.py``'s job: one JSON object per task, with
    ``python`` and ``version``, or ``error``), or None when every one can run this hvd_spark."""
    for raw in answers:
        try:
            answer = json.loads(raw)
        except ValueError:
            continue  # not an answer of this check
        python = str(answer.get("python", ""))
        if answer.get("error"):
            return ExecutorPythonError(python, str(answer["error"]), driver_version)
        version = str(answer.get("version", ""))
        if version != driver_version:
            problem = f"it has hvd_spark {version or '(unknown version)'}, the driver {driver_version}"
            return ExecutorPythonError(python, problem, driver_version, version)
    return None
