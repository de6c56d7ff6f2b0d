"""transform's invalid rows without Spark: NaNs and infinities found row by row in Arrow columns
(scalars, lists, nested lists, with nulls around them), and hvd_spark's own error raised from a UDF
worker as its message alone."""

import os

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
    assert os.environ["SPARK_HIDE_TRACEBACK"] == "1"  # pyspark's worker then writes the message alone
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert not getattr(raised.value, "__notes__", None)
    monkeypatch.delenv("SPARK_HIDE_TRACEBACK")

    def other():
        raise ValueError("a bug of yours")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match="a bug"):
        list(short_errors(other()))
    assert "SPARK_HIDE_TRACEBACK" not in os.environ  # any other error keeps its traceback
