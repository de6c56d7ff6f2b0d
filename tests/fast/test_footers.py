"""Statistics of a table read in place from its Parquet footers (data/footers.py): wherever the footer
gives a column's statistics they equal those the scan computes from the values
(common/sources.row_group_stats), and where they cannot be exact (floats, arrays, a range beyond a
cast, nulls in a group, a validation column, a footer without statistics) the footer gives none.
Real Parquet files, no Spark."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common import sources
from hvd_spark._internal.data import footers


def _col(stored, kind, names, dtype, label=None):
    return sources.SourceColumn(stored, kind, tuple(names), dtype, label or names[0])


def _write(tmp_path, table, **kw):
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=kw.pop("row_group_size", 40), **kw)
    pf = pq.ParquetFile(path)
    return path, pf


def _scanned(source, url, pf):
    """row_group_stats of every non-empty row group, read from the values (what the scan computes)."""
    offsets = sources.group_offsets(pf.metadata)
    return [
        sources.row_group_stats(source, url, pf.read_row_group(g), offsets[g])
        for g in range(pf.num_row_groups)
        if pf.metadata.row_group(g).num_rows
    ]


def _table(n=100):
    rng = np.random.default_rng(3)
    ints = rng.integers(-50, 50, n)
    return pa.table(
        {
            "i8": pa.array(ints.astype("int8"), pa.int8()),
            "i8n": pa.array([None if k % 7 == 0 else int(v) for k, v in enumerate(ints)], pa.int8()),
            "u32": pa.array(rng.integers(0, 2**32 - 1, n, dtype="uint64").astype("uint32"), pa.uint32()),
            "i64": pa.array(rng.integers(-(2**40), 2**40, n), pa.int64()),
            "small64": pa.array(rng.integers(-1000, 1000, n), pa.int64()),
            "flag": pa.array([None if k % 5 == 0 else bool(k % 2) for k in range(n)], pa.bool_()),
            "name": pa.array([None if k % 3 == 0 else f"n{k}" for k in range(n)], pa.string()),
            "f": pa.array(rng.normal(size=n)),
            "arr": pa.array([[float(k), 1.0] for k in range(n)], pa.list_(pa.float32())),
            "label": pa.array(rng.integers(0, 3, n), pa.int32()),
        }
    )


EXACT = [
    _col("c0", "scalar", ["i8"], "int8"),
    _col("c1", "scalar", ["i8n"], "int8"),
    _col("c2", "scalar", ["u32"], "int64"),  # uint32 read as bigint by Spark
    _col("c3", "scalar", ["i64"], "int64"),
    _col("c4", "scalar", ["small64"], "int32"),  # cast to int: in range
    _col("c5", "scalar", ["flag"], "int32"),  # a boolean stored as int32
    _col("c6", "scalar", ["name"], "string"),
    _col("c7", "scalar", ["i64"], "float32", label="i64 as float"),  # an integer cast to float
    _col("c8", "group", ["i8", "small64", "label"], "int64", label="[i8, small64, label]"),
    _col("c9", "scalar", ["label"], "int32"),
]


@pytest.mark.parametrize("split", [(), ("fraction", 0.3, 7), ("files", ())])
def test_footer_statistics_equal_the_scanned_ones(tmp_path, split):
    path, pf = _write(tmp_path, _table())
    if split and split[0] == "files":
        split = ("files", (path,))
    source = sources.TableSource(tuple(EXACT), split, root=str(tmp_path))
    found = footers.file_stats(source, path, pf.metadata, pf.schema_arrow)
    scanned = _scanned(source, path, pf)
    assert len(found) == len(scanned) == 3  # 100 rows in row groups of 40
    for (_, _, st), want in zip(found, scanned):
        assert st["missing"] == []
        assert footers.completed(source, st, None) == want
    merged = sources.merge_stats([footers.completed(source, st, None) for _, _, st in found])
    assert merged == sources.merge_stats(scanned)
    # the numbers that prove it read something: nulls counted, ranges of the values
    cols = merged["columns"]
    assert cols["i8n"]["bad"] == 15 and cols["flag"]["bad"] == 20 and cols["name"]["bad"] == 34
    assert (cols["flag"]["min"], cols["flag"]["max"]) == (0, 1)
    t = _table()
    assert cols["u32"]["max"] == int(pa.compute.max(t["u32"]).as_py())
    assert merged["val_rows"] == (100 if split and split[0] == "files" else 0 if not split else merged["val_rows"])
    if split and split[0] == "fraction":
        assert 15 < merged["val_rows"] < 45


def test_what_the_footer_cannot_give_is_read_from_the_values(tmp_path):
    t = _table()
    path, pf = _write(tmp_path, t)
    inexact = [
        _col("f", "scalar", ["f"], "float32"),  # NaN is not in a footer
        _col("arr", "array", ["arr"], "float32"),  # lengths per row
        _col("narrow", "scalar", ["i64"], "int32", label="i64 as int"),  # beyond int32: counted from values
        _col("g", "group", ["i8n", "i8"], "int32", label="[i8n, i8]"),  # nulls in a group
    ]
    source = sources.TableSource(tuple(EXACT + inexact), ())
    found = footers.file_stats(source, path, pf.metadata, pf.schema_arrow)
    scanned = _scanned(source, path, pf)
    assert footers.needs_values(source, pf.schema_arrow)
    for (g, first, st), want in zip(found, scanned):
        assert st["missing"] == ["f", "arr", "i64 as int", "[i8n, i8]"]
        sub = sources.TableSource(footers.missing_columns(source, st["missing"]), ())
        table = pf.read_row_group(g, columns=sub.file_columns())
        part = sources.row_group_stats(sub, path, table, first)
        assert footers.completed(source, st, part) == want
    assert sources.merge_stats(scanned)["columns"]["i64 as int"]["overflow"] > 0


def test_a_validation_column_needs_the_values(tmp_path):
    path, pf = _write(tmp_path, _table())
    source = sources.TableSource((EXACT[0],), ("column", "flag"))
    assert footers.needs_values(source, pf.schema_arrow)
    assert all(st is None for _, _, st in footers.file_stats(source, path, pf.metadata, pf.schema_arrow))


def test_a_footer_without_statistics_gives_none(tmp_path):
    path, pf = _write(tmp_path, _table(), write_statistics=False)
    source = sources.TableSource(tuple(EXACT), ())
    found = footers.file_stats(source, path, pf.metadata, pf.schema_arrow)
    assert found and all(st["missing"] == [c.label for c in EXACT] for _, _, st in found)


def test_empty_row_groups_and_all_null_columns(tmp_path):
    t = pa.table({"a": pa.array([None] * 30, pa.int32()), "s": pa.array([None] * 30, pa.string())})
    path, pf = _write(tmp_path, t, row_group_size=10)
    cols = (_col("a", "scalar", ["a"], "int32"), _col("s", "scalar", ["s"], "string"))
    source = sources.TableSource(cols, ())
    found = footers.file_stats(source, path, pf.metadata, pf.schema_arrow)
    assert [footers.completed(source, st, None) for _, _, st in found] == _scanned(source, path, pf)
    assert found[0][2]["columns"]["a"] == found[0][2]["columns"]["a"] | {"bad": 10, "min": None, "max": None}
