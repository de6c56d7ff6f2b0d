"""A table read in place (common/sources.py, rank/rows.py's ParquetSet): file columns converted to
what the copy stores, the validation split by file and row number, row-group statistics, and files
changed under a fit. Real Parquet files, no Spark."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark import DataChangedError
from hvd_spark._internal.common import sources
from hvd_spark._internal.common.dataplan import Unit
from hvd_spark._internal.rank.rows import ParquetSet

VECTOR = pa.struct(
    [
        pa.field("type", pa.int8(), nullable=False),
        pa.field("size", pa.int32()),
        pa.field("indices", pa.list_(pa.int32())),
        pa.field("values", pa.list_(pa.float64())),
    ]
)


def _vectors(rows):
    """Spark ML's Parquet layout of Vectors: dense (type 1, values) or sparse (type 0, size, indices, values)."""
    out = []
    for r in rows:
        if isinstance(r, dict):
            out.append({"type": 0, "size": r["size"], "indices": r["indices"], "values": r["values"]})
        else:
            out.append({"type": 1, "size": None, "indices": None, "values": r})
    return pa.array(out, type=VECTOR)


def _col(stored, kind, names, dtype, label=None):
    return sources.SourceColumn(stored, kind, tuple(names), dtype, label or names[0])


def test_values_match_what_the_copy_stores():
    table = pa.table(
        {
            "v": _vectors([[1.0, 2.0, 3.0], {"size": 3, "indices": [2], "values": [5.0]}, [0.5, 0.0, -1.0]]),
            "a": pa.array([[1, 2], [3, 4], [5, 6]], type=pa.list_(pa.int64())),
            "b": pa.array([True, False, True]),
            "d": pa.array([1, 2, 3], type=pa.decimal128(5, 2)).cast(pa.decimal128(5, 2)),
            "x": pa.array([1.5, 2.5, -3.5]),
            "i": pa.array([7, 8, 9], type=pa.int64()),
        }
    )
    got = {
        "vector": sources.values_of(_col("c0", "vector", ["v"], "float32"), table),
        "array": sources.values_of(_col("c1", "array", ["a"], "int32"), table),
        "group": sources.values_of(_col("c2", "group", ["b", "x", "i"], "float32"), table),
        "bool": sources.values_of(_col("c3", "scalar", ["b"], "int32"), table),
        "decimal": sources.values_of(_col("c4", "scalar", ["d"], "float64"), table),
        "cast": sources.values_of(_col("c5", "scalar", ["x"], "int32"), table),  # cast(x as int): toward zero
    }
    np.testing.assert_array_equal(got["vector"], np.array([[1, 2, 3], [0, 0, 5], [0.5, 0, -1]], np.float32))
    assert got["vector"].dtype == np.float32
    np.testing.assert_array_equal(got["array"], [[1, 2], [3, 4], [5, 6]])
    assert got["array"].dtype == np.int32
    np.testing.assert_array_equal(got["group"], [[1, 1.5, 7], [0, 2.5, 8], [1, -3.5, 9]])
    np.testing.assert_array_equal(got["bool"], [1, 0, 1])
    np.testing.assert_array_equal(got["decimal"], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(got["cast"], [1, 2, -3])


def test_row_group_statistics_find_nulls_nans_lengths_and_ranges():
    table = pa.table(
        {
            "x": pa.array([1.0, None, float("nan"), 4.5]),
            "a": pa.array([[1.0, 2.0], [1.0], None, [2.0, float("nan")]]),
            "v": _vectors([[1.0, 2.0], {"size": 5, "indices": [1], "values": [1.0]}, [3.0, 4.0], [1.0, 2.0]]),
            "y": pa.array([0, 1, 2, 1]),
        }
    )
    source = sources.TableSource(
        (
            _col("c0", "scalar", ["x"], "float64"),
            _col("c1", "array", ["a"], "float32"),
            _col("c2", "vector", ["v"], "float32"),
            _col("c3", "scalar", ["y"], "int64"),
        )
    )
    s = sources.row_group_stats(source, "f.parquet", table, 0)
    assert s["rows"] == 4 and s["val_rows"] == 0
    assert s["columns"]["x"]["bad"] == 2 and s["columns"]["x"]["min"] == 1.0 and s["columns"]["x"]["max"] == 4.5
    assert s["columns"]["x"]["fractional"] == 1
    assert s["columns"]["a"]["bad"] == 2  # the null row and the row holding NaN
    assert (s["columns"]["a"]["min_len"], s["columns"]["a"]["max_len"]) == (1, 2)
    assert (s["columns"]["v"]["min_len"], s["columns"]["v"]["max_len"]) == (2, 5)  # a sparse row's size
    assert (s["columns"]["y"]["min"], s["columns"]["y"]["max"], s["columns"]["y"]["fractional"]) == (0, 2, 0)
    merged = sources.merge_stats([s, sources.row_group_stats(source, "f.parquet", table.slice(3), 3)])
    assert merged["rows"] == 5 and merged["columns"]["x"]["bad"] == 2 and merged["columns"]["a"]["max_len"] == 2


def test_the_split_depends_on_file_name_and_row_number_only():
    source = sources.TableSource((), ("fraction", 0.25, 7))
    table = pa.table({"x": np.arange(20000.0)})
    whole, _ = sources.split_mask(source, "s3://b/t/part-0.parquet", table, 0)
    assert 0.24 < whole.mean() < 0.26
    # the same rows read as two row groups, from another folder or scheme: the same split
    head, _ = sources.split_mask(source, "file:///x/part-0.parquet", table.slice(0, 5000), 0)
    tail, _ = sources.split_mask(source, "file:///x/part-0.parquet", table.slice(5000), 5000)
    np.testing.assert_array_equal(np.concatenate([head, tail]), whole)
    other, _ = sources.split_mask(source, "s3://b/t/part-1.parquet", table, 0)
    assert (other != whole).mean() > 0.3  # another file splits otherwise
    reseeded, _ = sources.split_mask(sources.TableSource((), ("fraction", 0.25, 8)), "part-0.parquet", table, 0)
    assert (reseeded != whole).mean() > 0.3


def test_a_validation_column_marks_rows_and_its_bad_values_are_counted():
    source = sources.TableSource((), ("column", "is_val"))
    table = pa.table({"is_val": pa.array([1, 0, None, 2, 1])})
    val, invalid = sources.split_mask(source, "f", table, 0)
    assert val.tolist() == [True, False, False, False, True]
    assert invalid.tolist() == [False, False, True, True, False]
    flags = pa.table({"IS_VAL": pa.array([True, False])})  # the file's spelling, matched ignoring case
    assert sources.split_mask(source, "f", flags, 0)[0].tolist() == [True, False]


def _write(path, n, groups=2):
    table = pa.table({"x": np.arange(n, dtype=np.float64), "y": np.arange(n) % 2})
    pq.write_table(table, path, row_group_size=n // groups)
    return str(path)


def test_a_rank_reads_its_side_of_each_row_group(tmp_path):
    path = _write(tmp_path / "part-0.parquet", 1000)
    status = sources.file_status(path, None)
    cols = (_col("c0", "scalar", ["x"], "float64"), _col("c1", "scalar", ["y"], "int64"))
    source = sources.TableSource(cols, ("fraction", 0.3, 1), (status,))
    val, _ = sources.split_mask(source, path, pq.read_table(path), 0)
    expected_val = np.arange(1000.0)[val]
    read = {}
    for side in sources.SIDES:
        data = ParquetSet([path], source=source, side=side)
        parts = []
        for g, rows in enumerate((int(val[:500].sum()), int(val[500:].sum()))):
            n = rows if side == "val" else 500 - rows
            parts.append(data.read(Unit(0, g, n), ["c0", "c1"])["c0"])
        read[side] = np.concatenate(parts)
    np.testing.assert_array_equal(read["val"], expected_val)
    assert sorted(np.concatenate([read["train"], read["val"]]).tolist()) == list(range(1000))


def test_a_changed_file_is_reported_not_read(tmp_path):
    path = _write(tmp_path / "part-0.parquet", 100, groups=1)
    cols = (_col("c0", "scalar", ["x"], "float64"),)
    status = sources.file_status(path, None)
    source = sources.TableSource(cols, (), (status,))
    assert ParquetSet([path], source=source).read(Unit(0, 0, 100), ["c0"])["c0"].shape == (100,)
    with pytest.raises(DataChangedError, match="holds 100 train rows now, 90 when the fit listed"):
        ParquetSet([path], source=source).read(Unit(0, 0, 90), ["c0"])
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 5_000_000_000))
    with pytest.raises(DataChangedError, match="changed after the fit listed"):
        ParquetSet([path], source=source).read(Unit(0, 0, 100), ["c0"])
    os.remove(path)
    with pytest.raises(DataChangedError, match="was removed"):
        ParquetSet([path], source=source).read(Unit(0, 0, 100), ["c0"])


def test_pages_that_do_not_decode_are_named_and_not_retried(tmp_path, caplog):
    """Garbage over a file's pages, its size and modification time put back (issue 47.4): the read fails at
    once (no retry as a store fault) with one short line naming the file and the row group."""
    import errno

    from hvd_spark.errors import DamagedFileError

    path = _write(tmp_path / "part-0.parquet", 1000, groups=1)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(np.random.default_rng(0).bytes(st.st_size // 2))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    source = sources.TableSource((_col("c0", "scalar", ["x"], "float64"),), (), (sources.file_status(path, None),))
    for data in (ParquetSet([path], source=source), ParquetSet([path])):  # in place; the store's copy
        with pytest.raises(DamagedFileError) as err:
            data.read(Unit(0, 0, 1000), ["c0"] if data.source else ["x"])
        first = str(err.value).splitlines()[0]
        assert first.startswith(f"{path} (row group 0) cannot be decoded: OSError: ") and len(first) < 500, first
    assert "retrying" not in caplog.text
    assert not sources.undecodable(ConnectionResetError(errno.ECONNRESET, "reset"))  # a fault of the way
    assert not sources.undecodable(FileNotFoundError(errno.ENOENT, "gone"))
    assert not sources.undecodable(DataChangedError("changed"))


def test_missing_and_unreadable_columns_name_the_file():
    schema = pa.schema([("x", pa.float64()), ("s", pa.string())])
    with pytest.raises(ValueError, match="column 'p' is not in the Parquet file f.parquet .a partition column"):
        sources.check_file_schema(sources.TableSource((_col("c0", "scalar", ["p"], "int32"),)), "f.parquet", schema)
    with pytest.raises(ValueError, match="column 's' of the Parquet file f.parquet has type string"):
        sources.check_file_schema(sources.TableSource((_col("c0", "scalar", ["s"], "float32"),)), "f.parquet", schema)
