"""The executors' Python check (common/requirements.py, errors.ExecutorPythonError): which failures of a
Spark job mean the executors' Python cannot run hvd_spark, the answers of the check job, the error's
one line. The Spark tests (tests/test_executor_python.py) run the real job."""

import json
import pickle

from hvd_spark import ExecutorPythonError, LaunchError
from hvd_spark._internal.common.requirements import executor_python_problem, executors_check
from hvd_spark._internal.common.restarts import should_restart

SPARK_ERROR = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 1.0 failed 1 times
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/tmp/wt/hvd_spark/_internal/task/barrier.py", line 14, in <module>
    import cloudpickle
ModuleNotFoundError: No module named 'cloudpickle'

\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:572)
"""


def test_a_failed_job_whose_executors_cannot_import_is_named_in_one_line():
    assert executor_python_problem(SPARK_ERROR) == "ModuleNotFoundError: No module named 'cloudpickle'"
    # the user's own missing module is not the executors' Python: a LaunchError as before (restartable)
    assert executor_python_problem(SPARK_ERROR.replace("'cloudpickle'", "'mylib'")) is None
    assert executor_python_problem("ImportError: cannot import name 'x' from 'hvd_spark.errors' (/a.py)")
    missing = 'java.io.IOException: Cannot run program "/opt/py/bin/python": error=2, No such file or directory'
    assert executor_python_problem(missing).startswith('Cannot run program "/opt/py/bin/python"')
    assert executor_python_problem("Job aborted: ExecutorLostFailure (executor 1 exited)") is None


def test_the_check_job_answers():
    ok = json.dumps({"python": "/venv/bin/python", "version": "0.1.0", "fp": "abc"})
    assert executors_check([ok, ok], "0.1.0") is None
    gone = json.dumps({"python": "/usr/bin/python3", "error": "ModuleNotFoundError: No module named 'hvd_spark'"})
    error = executors_check([ok, gone], "0.1.0")
    assert isinstance(error, ExecutorPythonError) and isinstance(error, LaunchError)
    assert error.python == "/usr/bin/python3" and "No module named 'hvd_spark'" in str(error)
    other = executors_check([json.dumps({"python": "/old/bin/python", "version": "0.0.9"})], "0.1.0")
    assert other is not None and "it has hvd_spark 0.0.9, the driver 0.1.0" in str(other)
    assert other.executor_version == "0.0.9"


def test_the_error_is_one_line_that_says_how_to_fix_it_and_is_never_restarted():
    error = ExecutorPythonError("/usr/bin/python3", "ModuleNotFoundError: No module named 'hvd_spark'", "0.1.0")
    text = str(error)
    assert len(text.splitlines()) == 1
    assert "PYSPARK_PYTHON" in text and "spark.pyspark.python" in text and "hvd_spark.local_session()" in text
    assert "hvd_spark 0.1.0" in text
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == text and again.python == "/usr/bin/python3"
    assert not should_restart(error, 0, 5)
    assert should_restart(LaunchError("tasks not scheduled"), 0, 5)
