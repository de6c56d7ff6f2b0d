"""The Spark jobs a fit runs on the driver on the user's behalf (the copy of the data to the store,
the scan of a table read in place, the listing of its input files, statistics, the first row of a
DataFrame): :func:`spark_job` turns their failures into one :class:`DataPreparationError` whose first
line says what hvd_spark was doing and the root cause, with Spark's own error as its ``__cause__``.

Spark's error for a failed job is the top of a chain (``Py4JJavaError: An error occurred while
calling o256.parquet.``, then ``SparkException: Job aborted...``) whose cause, the thing a user can
act on (``No space left on device``, their UDF's ``ValueError``), is thousands of characters down.
:func:`root_cause` finds it: the innermost Java exception of a py4j error's ``getCause()`` chain;
for pyspark's own exceptions (classic captured ones, Spark Connect's) what they expose, their text and
its last ``Caused by:`` line; for an exception raised by Python code on an executor, its last line
with the function, file and line that raised it.

Loads nothing heavy: Spark's errors are recognised by the module of their type and read through
duck typing, so the fast tests drive the text functions.

Console noise: Spark itself logs a failed task at ERROR (the executor's ``Exception in task`` and the
scheduler's ``aborting job``, with their stack traces) before the error reaches hvd_spark. Those
lines come from log4j loggers shared by the whole JVM (and on a cluster from the executors' own
JVMs), so they are left as they are: lowering them for a fit would hide the user's other jobs'
errors meanwhile.
"""

import contextlib
import posixpath
import re
from collections.abc import Iterator

from hvd_spark.errors import DataPreparationError, HvdSparkError

_TRACEBACK = "Traceback (most recent call last):"
_CAUSED_BY = re.compile(r"^\s*Caused by:\s*(.+?)\s*$", re.MULTILINE)
_SQLSTATE = re.compile(r"\s*SQLSTATE: \w+\.?\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_PYTHON_EXCEPTION = "org.apache.spark.api.python.PythonException"
_MAX_CAUSE = 600  # characters of the cause in the first line


@contextlib.contextmanager
def spark_job(what: str) -> Iterator[None]:
    """Runs the block (one or more Spark actions); a Spark error in it is raised again as a
    :class:`DataPreparationError` whose first line is ``"<what>: <root cause>"``, the original as its
    ``__cause__``. hvd_spark's own errors and other Python exceptions (a check failing, a store
    operation) pass unchanged.

    Args:
        what: what hvd_spark was doing, in words a user recognises, naming the store's URL without
            credentials where the job writes to it (``"writing the training data to s3://b/p/..."``).
    """
    try:
        yield
    except HvdSparkError:
        raise
    except Exception as e:
        if not is_spark_error(e):
            raise
        cause = root_cause(e)
        head = _SQLSTATE.sub("", _first_line(_text(e)))[:300]
        raise DataPreparationError(
            f"{what}: {cause}\nSpark's error is this error's __cause__, with its stack traces: {type(e).__name__}: "
            f"{head}",
            what=what,
            root_cause=cause,
        ) from e


def is_spark_error(error: BaseException) -> bool:
    """Whether ``error`` is py4j's or pyspark's (a failed job, a lost JVM, a Spark Connect error)."""
    return any(c.__module__.split(".", 1)[0] in ("py4j", "pyspark") for c in type(error).__mro__)


def root_cause(error: BaseException) -> str:
    """The innermost cause of a Spark error, one line: ``"java.io.IOException: No space left on
    device"``, or for Python code that raised on an executor ``"ValueError: bad row (raised in f,
    udfs.py:12)"``."""
    java = _java_exception(error)
    if java is not None:
        with contextlib.suppress(Exception):  # the JVM may be gone: the text below still holds the chain
            return _clip(_java_root(java))
    return _clip(root_cause_from_text(_error_text(error), type(error).__name__))


def root_cause_from_text(text: str, name: str = "") -> str:
    """The root cause in an error's text: the exception of its last Python traceback (a Python worker's
    error), else its last ``Caused by:`` line, else its first line (prefixed with ``name``)."""
    if _TRACEBACK in text:
        found = python_error(text)
        if found:
            return found
    causes = _CAUSED_BY.findall(text)
    if causes:
        return _SQLSTATE.sub("", causes[-1])
    first = _SQLSTATE.sub("", _first_line(text))
    if name and not first.startswith(name):
        return f"{name}: {first}" if first else name
    return first or name


def python_error(text: str) -> str:
    """The exception line of the last Python traceback in ``text``, with where it was raised:
    ``"ValueError: bad row (raised in label_of, udfs.py:12)"``; "" when there is none."""
    start = text.rfind(_TRACEBACK)
    if start < 0:
        return ""
    lines = text[start + len(_TRACEBACK) :].splitlines()[1:]
    frame = None
    for line in lines:
        m = _FRAME.match(line)
        if m:
            frame = m
            continue
        if not line.strip() or line[:1] in (" ", "\t"):
            continue  # a frame's source line, a caret line
        error = _SQLSTATE.sub("", line.strip())
        if frame is None:
            return error
        return f"{error} (raised in {frame['func']}, {posixpath.basename(frame['file'])}:{frame['line']})"
    return ""


def _java_exception(error: BaseException):
    """The Java exception behind ``error``: py4j's ``java_exception``, on it or on an exception it was
    raised from or while handling (pyspark raises its own exceptions while handling py4j's)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        java = getattr(e, "java_exception", None)
        if java is not None:
            return java
        e = e.__cause__ or e.__context__
    return None


def _java_root(java) -> str:
    """``"<class>: <message>"`` of the innermost exception of a Java exception's ``getCause()`` chain;
    for a Python worker's error, the Python exception it carries."""
    for _ in range(64):  # a cycle (Java allows one) or a very deep chain: the deepest reached
        cause = java.getCause()
        if cause is None:
            break
        java = cause
    name = str(java.getClass().getName())
    message = java.getMessage()
    message = "" if message is None else str(message)
    if name == _PYTHON_EXCEPTION or _TRACEBACK in message:
        found = python_error(message)
        if found:
            return found
    first = _SQLSTATE.sub("", _first_line(message))
    return f"{name}: {first}" if first else name


def _error_text(error: BaseException) -> str:
    """``str(error)`` and, where the error exposes it (Spark Connect), the server's stack trace with its
    ``Caused by:`` lines."""
    text = _text(error)
    with contextlib.suppress(Exception):
        trace = error.getStackTrace()  # type: ignore[attr-defined]  # Spark Connect's exceptions
        if trace:
            text += "\n" + str(trace)
    return text


def _text(error: BaseException) -> str:
    """``str(error)``; py4j's asks the JVM for it, which may be gone: then the type's name."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a py4j error whose JVM is gone
        return type(error).__name__


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_CAUSE else text[: _MAX_CAUSE - 3] + "..."
