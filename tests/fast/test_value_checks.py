"""Values the model cannot take, found in the statistics before any work (pure: no Spark, no TF):
64-bit ids kept whole where the model takes them, refused where a cast would wrap them, and
infinities counted with nulls and NaNs, on the copy's checks (data/stats.py's check_stats) and a
table read in place (common/sources.py)."""

import numpy as np
import pyarrow as pa
import pytest

from hvd_spark._internal.common import sources
from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec, beyond_range, check_value_range
from hvd_spark._internal.data.stats import check_stats

BIG = 2**31 + 75_665  # an id beyond int32
INF = float("inf")
VECTOR = pa.struct(
    [
        pa.field("type", pa.int8(), nullable=False),
        pa.field("size", pa.int32()),
        pa.field("indices", pa.list_(pa.int32())),
        pa.field("values", pa.list_(pa.float64())),
    ]
)


def _col(kind, names, dtype, label=None):
    return sources.SourceColumn("c0", kind, tuple(names), dtype, label or names[0])


def test_value_ranges_against_the_type_the_model_gets():
    assert beyond_range(0, BIG, "int32") == BIG
    assert beyond_range(-BIG, 5, "int32") == -BIG
    assert beyond_range(0, BIG, "int64") is None
    assert beyond_range(0, 2**63, "int64") == 2**63
    assert beyond_range(-1, 3, "uint8") == -1
    assert beyond_range(0.0, 1e39, "float32") == 1e39
    assert beyond_range(0.0, 1e39, "float64") is None
    assert beyond_range(None, None, "int32") is None
    assert beyond_range(0, BIG, "string") is None
    spec = TensorSpec("ids", (2,), "int32")
    with pytest.raises(
        ValueError,
        match=rf"Feature column 'ids' holds values from 3 to {BIG}; model input 'ids' "
        rf"takes int32, and {BIG} is beyond int32's range \[-2147483648, 2147483647\]\. .*dtype='int64'",
    ):
        check_value_range("feature", "ids", 3, BIG, "int32", spec)
    check_value_range("feature", "ids", 3, BIG, "int64", TensorSpec("ids", (2,), "int64"))
    with pytest.raises(
        ValueError,
        match=rf"Label column 'y' holds values from 0 to {BIG}; the model gets its values as "
        r"int32.*cast the column to double",
    ):
        check_value_range("label", "y", 0, BIG, "int32")
    with pytest.raises(ValueError, match=r"holds values from -1e\+300 to 1.*would become infinite"):
        check_value_range("feature", "x", -1e300, 1.0, "float32", TensorSpec("x", (1,), "float32"))


def _stats(**column):
    base = {"bad": 0, "min_len": 2, "max_len": 2, "min": 0, "max": 1, "fractional": 0}
    label = {**base, "min_len": None, "max_len": None}
    return {"rows": 100, "val_rows": 0, "val_nulls": 0, "columns": {"ids": {**base, **column}, "y": label}}


def _check(stats, dtype="int32", label_integer=True):
    check_stats(
        stats,
        [ColumnInfo("ids", "array", "bigint", True, stored="c0")],
        [ColumnInfo("y", "scalar", "bigint" if label_integer else "double", label_integer, stored="c1")],
        None,
        [TensorSpec("ids", (2,), dtype)],
        [TensorSpec("out", (1,), "float32")],
        None,
        2,
    )


def test_check_stats_refuses_what_the_model_cannot_take_before_any_work():
    _check(_stats(min=3, max=BIG), dtype="int64")  # an int64 input takes 64-bit ids
    with pytest.raises(ValueError, match=rf"Feature column 'ids' holds values from 3 to {BIG}; model input 'ids'"):
        _check(_stats(min=3, max=BIG))
    with pytest.raises(ValueError, match=r"Feature column 'ids' has 3 of 100 rows with null, NaN or infinite values"):
        _check(_stats(bad=3))
    with pytest.raises(
        ValueError,
        match=rf"Feature column 'ids' has 2 of 100 rows with values beyond the range of "
        rf"int32, the type the DataFrame casts it to \(e\.g\. {BIG}\)",
    ):
        _check(_stats(overflow=2, overflow_value=BIG, cast="int32"))
    labels = _stats()
    labels["columns"]["y"].update(min=0, max=BIG)
    with pytest.raises(ValueError, match=rf"Label column 'y' holds values from 0 to {BIG}"):
        _check(labels, dtype="int64")
    labels["columns"]["y"].update(min=0.0, max=1e300)
    with pytest.raises(ValueError, match=r"Label column 'y' holds values from 0 to 1e\+300.*infinite"):
        _check(labels, dtype="int64", label_integer=False)


def test_bigint_arrays_and_groups_are_stored_as_int64():
    assert sources.stored_dtype("array", "bigint", True) == "int64"
    assert sources.stored_dtype("group", "bigint", True) == "int64"  # a group holding a bigint column
    assert sources.stored_dtype("array", "int", True) == "int32"
    assert sources.stored_dtype("group", "int", True) == "int32"
    assert sources.stored_dtype("group", "float", False) == "float32"
    assert sources.stored_dtype("scalar", "bigint", True) == "int64"
    ids = pa.array([[BIG, 2**40 + 1], [7, BIG + 1]], type=pa.list_(pa.int64()))
    table = pa.table({"ids": ids, "a": pa.array([BIG, 7], pa.int64()), "b": pa.array([3, 8], pa.int32())})
    array = sources.values_of(_col("array", ["ids"], "int64"), table)
    group = sources.values_of(_col("group", ["a", "b"], "int64"), table)
    assert array.dtype == np.int64 and array.tolist() == [[BIG, 2**40 + 1], [7, BIG + 1]]
    assert group.dtype == np.int64 and group.tolist() == [[BIG, 3], [7, 8]]
    source = sources.TableSource((_col("array", ["ids"], "int64"), _col("group", ["a", "b"], "int64", "[a, b]")))
    s = sources.row_group_stats(source, "f", table, 0)["columns"]
    assert (s["ids"]["min"], s["ids"]["max"], s["ids"]["bad"], s["ids"]["overflow"]) == (7, 2**40 + 1, 0, 0)
    assert (s["[a, b]"]["min"], s["[a, b]"]["max"]) == (3, BIG)
    assert all(isinstance(s[c][k], int) for c in s for k in ("min", "max"))  # exact, not doubles


def test_a_cast_beyond_the_integer_range_is_counted_not_wrapped():
    """The DataFrame casts a bigint column (or array) to int: the ranks would cast it with numpy,
    which wraps; the rows beyond int32 are counted, with one value, as Spark's ANSI cast refuses them."""
    table = pa.table(
        {
            "a": pa.array([1, BIG, -BIG, 4], pa.int64()),
            "ids": pa.array([[1, 2], [3, BIG], [5, 6], [7, 8]], type=pa.list_(pa.int64())),
            "x": pa.array([1.5, 3e9, float("nan"), 2.0]),
        }
    )
    cols = (_col("scalar", ["a"], "int32"), _col("array", ["ids"], "int32"), _col("scalar", ["x"], "int32"))
    s = sources.row_group_stats(sources.TableSource(cols), "f", table, 0)["columns"]
    assert (s["a"]["overflow"], s["a"]["overflow_value"], s["a"]["cast"], s["a"]["bad"]) == (2, BIG, "int32", 0)
    assert (s["a"]["min"], s["a"]["max"]) == (1, 4)  # of the rows that fit
    assert (s["ids"]["overflow"], s["ids"]["overflow_value"], s["ids"]["max"]) == (1, BIG, 8)
    assert (s["x"]["overflow"], s["x"]["overflow_value"], s["x"]["bad"]) == (1, 3e9, 1)  # NaN: bad, not overflow
    merged = sources.merge_stats(
        [sources.row_group_stats(sources.TableSource(cols), "f", table.slice(i, 1), i) for i in range(4)]
    )
    assert (merged["columns"]["a"]["overflow"], merged["columns"]["a"]["overflow_value"]) == (2, BIG)


def test_infinities_are_counted_with_nulls_and_nans_in_every_kind_of_column():
    vectors = pa.array(
        [
            {"type": 1, "size": None, "indices": None, "values": [1.0, -INF]},
            {"type": 0, "size": 2, "indices": [1], "values": [INF]},
            {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0]},
            {"type": 1, "size": None, "indices": None, "values": [0.5, 2.0]},
        ],
        type=VECTOR,
    )
    table = pa.table(
        {
            "s": pa.array([INF, 1.0, -INF, 2.0]),
            "f": pa.array([1.0, 2.0, 3.0, INF], pa.float32()),
            "arr": pa.array([[1.0, 2.0], [INF, 1.0], [3.0, 4.0], [1e300, 0.0]]),  # 1e300: infinite in float32
            "v": vectors,
            "i": pa.array([1, 2, 3, 4]),
        }
    )
    cols = (
        _col("scalar", ["s"], "float64"),
        _col("group", ["i", "f"], "float32", "[i, f]"),
        _col("array", ["arr"], "float32"),
        _col("vector", ["v"], "float32"),
        _col("scalar", ["f"], "int32", "cast"),  # cast(f as int): an infinity is refused like a NaN
    )
    s = sources.row_group_stats(sources.TableSource(cols), "f", table, 0)["columns"]
    assert {name: s[name]["bad"] for name in s} == {"s": 2, "[i, f]": 1, "arr": 2, "v": 2, "cast": 1}
    assert (s["s"]["min"], s["s"]["max"]) == (1.0, 2.0)
    assert (s["v"]["min"], s["v"]["max"]) == (0.5, 2.0)
    assert (s["arr"]["min"], s["arr"]["max"]) == (1.0, 4.0)
