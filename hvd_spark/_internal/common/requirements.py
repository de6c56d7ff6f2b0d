"""The optional pieces hvd_spark needs where it runs, and the error that names the extra to install.

A bare ``pip install hvd_spark`` brings neither Spark nor TensorFlow (pyproject.toml explains why):
the user picks ``spark`` or ``connect-client`` and ``cpu`` or ``gpu``, or uses the ones a managed
runtime provides. The checks look the packages up without importing them (``find_spec`` of a
top-level name loads nothing), so they cost nothing where the packages are there.
"""

import importlib.util

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
