"""The errors of the Spark jobs a fit runs on the driver (data/jobs.py): the first line says what
hvd_spark was doing and the root cause, found in a py4j error's Java chain or in pyspark's text; no
Spark here: py4j's and pyspark's errors are played by look-alikes."""

import pickle

import pytest

import hvd_spark
from hvd_spark._internal.data.jobs import python_error, root_cause, root_cause_from_text, spark_job


class _JavaClass:
    def __init__(self, name):
        self.name = name

    def getName(self):  # noqa: N802 - Java's names
        return self.name


class _Java:
    """A Java exception as py4j shows it."""

    def __init__(self, name, message, cause=None):
        self.name, self.message, self.cause = name, message, cause

    def getCause(self):  # noqa: N802
        return self.cause

    def getClass(self):  # noqa: N802
        return _JavaClass(self.name)

    def getMessage(self):  # noqa: N802
        return self.message


class Py4JJavaError(Exception):
    __module__ = "py4j.protocol"

    def __init__(self, text, java):
        super().__init__(text)
        self.java_exception = java


class PythonException(Exception):
    __module__ = "pyspark.errors.exceptions.captured"


class SparkException(Exception):  # Spark Connect's: its server's stack trace through getStackTrace()
    __module__ = "pyspark.errors.exceptions.connect"

    def __init__(self, message, trace):
        super().__init__(message)
        self.trace = trace

    def getStackTrace(self):  # noqa: N802
        return self.trace


_UDF_TRACEBACK = """[PYTHON_EXCEPTION] An exception was thrown from the Python worker: \
Traceback (most recent call last):
  File "/home/me/jobs/labels.py", line 18, in label_of
    raise ArithmeticError(f"no label for row {v}")
ArithmeticError: no label for row 7
 SQLSTATE: 38000"""


def _full_disk() -> Py4JJavaError:
    java = _Java(
        "org.apache.spark.SparkException",
        "[TASK_WRITE_FAILED] Task failed while writing rows to file:/s/data/k/a. SQLSTATE: 58030",
        _Java(
            "org.apache.hadoop.fs.FSError",
            "java.io.IOException: No space left on device",
            _Java("java.io.IOException", "No space left on device"),
        ),
    )
    return Py4JJavaError("An error occurred while calling o256.parquet.\n: org.apache.spark.SparkException: ...", java)


def test_a_py4j_error_becomes_one_whose_first_line_says_what_and_the_innermost_java_cause():
    original = _full_disk()
    with pytest.raises(hvd_spark.DataPreparationError) as info:
        with spark_job("writing the training data to s3://bucket/store/data/k/a"):
            raise original
    first, *rest = str(info.value).splitlines()
    assert (
        first == "writing the training data to s3://bucket/store/data/k/a: java.io.IOException: No space left on device"
    )
    assert "Py4JJavaError: An error occurred while calling o256.parquet." in rest[0]
    assert info.value.__cause__ is original
    assert info.value.root_cause == "java.io.IOException: No space left on device"
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.what, copy.root_cause) == (str(info.value), info.value.what, info.value.root_cause)


def test_a_users_udf_error_is_named_with_where_it_was_raised():
    java = _Java(
        "org.apache.spark.SparkException",
        "Job aborted",
        _Java("org.apache.spark.api.python.PythonException", _UDF_TRACEBACK),
    )
    assert root_cause(Py4JJavaError("An error occurred", java)) == (
        "ArithmeticError: no label for row 7 (raised in label_of, labels.py:18)"
    )
    # pyspark's captured exception, raised while handling py4j's: the Java chain behind it is found
    try:
        try:
            raise Py4JJavaError("An error occurred", java)
        except Py4JJavaError:
            raise PythonException("An exception was thrown from the Python worker:") from None
    except PythonException as e:
        assert root_cause(e) == "ArithmeticError: no label for row 7 (raised in label_of, labels.py:18)"
    # text only (Spark Connect's PythonException, a lost JVM)
    text = "An exception was thrown from the Python worker:\n" + _UDF_TRACEBACK.split(": ", 1)[1]
    assert python_error(text) == "ArithmeticError: no label for row 7 (raised in label_of, labels.py:18)"


def test_the_text_gives_the_last_caused_by_or_the_first_line():
    trace = (
        "org.apache.spark.SparkException\n\tat x.y(Z.scala:1)\nCaused by: org.apache.hadoop.fs.FSError: "
        "java.io.IOException: No space left on device\n\tat a.b(C.java:2)\n"
        "Caused by: java.io.IOException: No space left on device\n\tat d.e(F.java:3)"
    )
    error = SparkException("[TASK_WRITE_FAILED] Task failed while writing rows to file:/s. SQLSTATE: 58030", trace)
    assert root_cause(error) == "java.io.IOException: No space left on device"
    assert root_cause_from_text("[X] it broke SQLSTATE: 42000\nmore", "AnalysisException") == (
        "AnalysisException: [X] it broke"
    )
    # the last of several tracebacks (an exception raised while handling another)
    chained = "Traceback (most recent call last):\nKeyError: 'a'\n\nDuring handling...\n" + _UDF_TRACEBACK
    assert root_cause_from_text(chained).startswith("ArithmeticError: no label for row 7")


def test_other_errors_pass_unchanged():
    for error in (
        ValueError("a check"),
        OSError(28, "No space left on device"),
        hvd_spark.RankFailedError(0, "X", "y"),
    ):
        with pytest.raises(type(error)) as info:
            with spark_job("writing"):
                raise error
        assert info.value is error


def test_a_java_exception_without_a_message_is_named_by_its_class():
    java = _Java("org.apache.spark.SparkException", "Job aborted", _Java("java.lang.NullPointerException", None))
    assert root_cause(Py4JJavaError("An error occurred", java)) == "java.lang.NullPointerException"
