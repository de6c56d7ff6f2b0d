"""The statistics of a table read in place taken from its Parquet footers, where they are exact.

A Parquet footer holds, per row group, its row count and per column chunk (usually) its null count
and the smallest and largest non-null value. The in-place scan (``data/inplace.py``) needs per row
group what ``common/sources.row_group_stats`` computes from the values; the footer gives exactly the
same numbers for:

* the rows of the row group, and the rows of each split for a validation fraction (a hash of the
  file's name and the row's number: no values needed) or validation files;
* a string or binary column (only its nulls are checked): its null count;
* an integer or boolean scalar column: its null count (nulls are its only bad values: integers have
  no NaN or infinity), and its range converted as the copy converts it, when that range fits the
  integer type the DataFrame casts to (else the rows beyond it must be counted: read the values);
* a group of such columns without nulls (with nulls, the rows to leave out differ per column).

It cannot give: anything of a floating point or decimal column (a footer's min / max leave NaN out
and it counts no NaN or infinity; the checks refuse those, and labels need their fractional values
counted), an array or Vector column (lengths per row), a validation column's flags. Those are read
from the row groups by the scan's Spark job, the rest is taken from here.

Pure pyarrow / numpy: runs on the driver and in the scan's Spark tasks. Loads neither Spark nor
TensorFlow.
"""

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark._internal.common import sources

logger = logging.getLogger(__name__)


def split_counts(source: sources.TableSource, url: str, rows: int, first_row: int) -> tuple[int, int] | None:
    """``(validation rows, validation flags that are null or not 0 / 1)`` of a row group of ``rows``
    rows starting at row ``first_row`` of the file at ``url``, when the split needs no values (no
    validation, a fraction, validation files); None for a validation column."""
    if not source.split:
        return 0, 0
    if source.split[0] == "files":
        return (rows if url in source.split[1] else 0), 0
    if source.split[0] == "fraction":
        _, fraction, seed = source.split
        key = sources.split_key(source.root, url)
        return int((sources._uniform(key, first_row, rows, seed) < float(fraction)).sum()), 0
    return None


def needs_values(source: sources.TableSource, schema) -> bool:
    """Whether some column of ``source`` (as ``schema``, a file's Arrow schema, types it) or the split
    can only be summarized from the values, whatever the footers hold."""
    if source.split and source.split[0] == "column":
        return True
    return any(not _typed_for_footer(col, schema) for col in source.columns)


def _typed_for_footer(col: sources.SourceColumn, schema) -> bool:
    import pyarrow as pa

    if col.kind not in ("scalar", "group"):
        return False
    for name in col.names:
        try:
            t = schema.field(sources.resolve(schema, name)).type
        except KeyError:
            return False
        if col.dtype == "string":
            if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                return False
        elif col.dtype == "binary":
            if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
                return False
        elif not (pa.types.is_integer(t) or pa.types.is_boolean(t)):
            return False
    return True


def _chunks(metadata) -> dict[str, int]:
    """{a top-level column's name: its index among a row group's column chunks} (nested columns,
    whose chunks are their leaves, are left out)."""
    out = {}
    for j in range(metadata.num_columns):
        path = metadata.schema.column(j).path
        if "." not in path:
            out[path] = j
    return out


def column_stats(col: sources.SourceColumn, schema, row_group, chunks: dict[str, int]) -> dict[str, Any] | None:
    """``row_group_stats``'s entry for ``col`` in one row group (``row_group``: its pyarrow
    ``RowGroupMetaData``) from the footer alone, or None when the footer cannot give it exactly."""
    if not _typed_for_footer(col, schema):
        return None
    n = row_group.num_rows
    target = None if col.dtype in sources.OBJECT_DTYPES else np.dtype(col.dtype)
    nulls, ranges, file_types = [], [], []
    for name in col.names:
        file_name = sources.resolve(schema, name)
        j = chunks.get(file_name)
        if j is None:
            return None
        st = row_group.column(j).statistics
        if st is None or not st.has_null_count or st.null_count is None:
            return None
        nulls.append(int(st.null_count))
        if target is None:
            continue
        if st.null_count < n and not st.has_min_max:
            return None
        ranges.append((st.min, st.max) if st.null_count < n else None)
        file_types.append(np.dtype(schema.field(file_name).type.to_pandas_dtype()))
    s: dict[str, Any] = {"bad": 0, "min_len": None, "max_len": None, "min": None, "max": None}
    s.update(fractional=0, overflow=0, overflow_value=None, cast=col.dtype)
    if col.kind == "group" and len(col.names) > 1 and any(nulls):
        return None  # the rows left out (a null in any column) are not those a column's range leaves out
    s["bad"] = max(nulls) if nulls else 0
    if target is None or s["bad"] == n:
        return s
    # As the scan converts: a group's columns are stacked (numpy's common type), then cast to the target.
    common = np.result_type(*file_types) if col.kind == "group" else file_types[0]
    low = high = None
    for rng, ftype in zip(ranges, file_types):
        if rng is None:
            continue
        lo, hi = rng
        lo_v, hi_v = np.array([lo, hi], dtype=ftype)
        if target.kind in "iu" and ftype.kind in "iuf" and not np.can_cast(ftype, target):
            info = np.iinfo(target)
            if lo_v < info.min or hi_v > info.max:
                return None  # rows beyond the cast's range: they must be counted, and one shown
        lo_c, hi_c = np.array([lo_v, hi_v], dtype=ftype).astype(common).astype(target)
        low = lo_c if low is None else min(low, lo_c)
        high = hi_c if high is None else max(high, hi_c)
    if low is None or high is None:
        return s
    s.update(min=low.item(), max=high.item())
    if col.kind == "group":
        s.update(min_len=len(col.names), max_len=len(col.names))
    return s


def file_stats(source: sources.TableSource, url: str, metadata, schema) -> list[tuple[int, int, dict | None]]:
    """``(row group, first row, statistics)`` of each non-empty row group of a file from its footer
    (``metadata``: its pyarrow ``FileMetaData``, ``schema``: its Arrow schema). The statistics are
    ``row_group_stats``'s with a ``"missing"`` list of the columns (labels) the footer could not
    give, whose entries are then absent; None when the split itself needs the values."""
    chunks = _chunks(metadata)
    offsets = sources.group_offsets(metadata)
    out: list[tuple[int, int, dict | None]] = []
    for g in range(metadata.num_row_groups):
        rg = metadata.row_group(g)
        n = rg.num_rows
        if n == 0:
            continue
        counts = split_counts(source, url, n, offsets[g])
        if counts is None:
            out.append((g, offsets[g], None))
            continue
        stats: dict[str, Any] = {"rows": n, "val_rows": counts[0], "val_nulls": counts[1], "columns": {}}
        missing = []
        for col in source.columns:
            try:
                s = column_stats(col, schema, rg, chunks)
            except Exception as e:  # noqa: BLE001 - statistics of a form not foreseen: the values tell
                logger.debug("the footer of %s gives no statistics of %s: %s", url, col.label, e)
                s = None
            if s is None:
                missing.append(col.label)
            else:
                stats["columns"][col.label] = s
        stats["missing"] = missing
        out.append((g, offsets[g], stats))
    return out


def completed(source: sources.TableSource, footer: dict, scanned: dict | None) -> dict:
    """A row group's statistics: the footer's (:func:`file_stats`), with the columns it lacked taken
    from ``scanned`` (``row_group_stats`` of those columns' values), in the columns' order."""
    columns = {}
    for col in source.columns:
        if col.label in footer["columns"]:
            columns[col.label] = footer["columns"][col.label]
        else:
            assert scanned is not None, col.label
            columns[col.label] = scanned["columns"][col.label]
    return {k: footer[k] for k in ("rows", "val_rows", "val_nulls")} | {"columns": columns}


def missing_columns(source: sources.TableSource, labels: Sequence[str]) -> tuple[sources.SourceColumn, ...]:
    """The columns of ``source`` with these labels."""
    wanted = set(labels)
    return tuple(c for c in source.columns if c.label in wanted)
