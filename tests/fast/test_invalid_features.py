"""transform's invalid rows without Spark: NaNs and infinities found row by row in Arrow columns
(scalars, lists, nested lists, with nulls around them), and hvd_spark's own error raised from a UDF
worker as its message alone."""

import os
import sys
import types

import pyarrow as pa
import pytest

from hvd_spark._internal.infer.batching import nonfinite_rows, null_element_rows, short_errors
from hvd_spark.errors import InvalidFeatureError

NAN, INF = float("nan"), float("inf")


def test_nonfinite_rows_of_scalars_lists_and_nested_lists():
    assert nonfinite_rows(pa.array([1.0, NAN, None, -INF, 2.0])).tolist() == [False, True, False, True, False]
    assert nonfinite_rows(pa.array([1.0, None, 2.0])) is None
    assert nonfinite_rows(pa.array([1, 2, None])) is None  # integers hold no NaN
    lists = pa.array([[1.0, 2.0], None, [3.0, INF], [], [None, NAN]])
    assert nonfinite_rows(lists).tolist() == [False, False, True, False, True]
    assert null_element_rows(lists).tolist() == [False, False, False, False, True]
    nested = pa.array([[[1.0], [NAN]], [[2.0]], None, [[3.0, -INF]]])
    assert nonfinite_rows(nested).tolist() == [True, False, False, True]
    sliced = pa.chunked_array([lists.slice(2, 3)])  # a slice's offsets do not start at 0
    assert nonfinite_rows(sliced).tolist() == [True, False, True]


def test_short_errors_raise_the_message_alone(monkeypatch):
    """pyspark's worker formats a UDF's error with its (private) ``handle_worker_exception``: hvd_spark's
    own error is reported without a traceback, that exception only; any other error of the same reused
    worker keeps its traceback (before: SPARK_HIDE_TRACEBACK was set for the worker's later tasks too)."""
    calls = []

    def handle_worker_exception(e, outfile, hide_traceback=None):  # pyspark.util's signature
        calls.append((e, hide_traceback))

    worker = types.ModuleType("pyspark.worker")
    worker.handle_worker_exception = handle_worker_exception
    monkeypatch.setitem(sys.modules, "pyspark.worker", worker)
    monkeypatch.delenv("SPARK_HIDE_TRACEBACK", raising=False)

    def failing():
        yield 1
        err = InvalidFeatureError("Feature column 'x' has 1 rows with NaN or infinite values")
        err.add_note("(raised in the inference process 12)")
        raise err

    got = short_errors(failing())
    assert next(got) == 1
    with pytest.raises(InvalidFeatureError) as raised:
        next(got)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert not getattr(raised.value, "__notes__", None)
    users = ValueError("a user's UDF, later in the same worker")
    worker.handle_worker_exception(raised.value, None)
    worker.handle_worker_exception(users, None)
    assert calls == [(raised.value, True), (users, None)]  # the message alone for hvd_spark's error only
    assert "SPARK_HIDE_TRACEBACK" not in os.environ

    def other():
        raise ValueError("a bug of yours")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match="a bug"):
        list(short_errors(other()))
    assert len(calls) == 2
