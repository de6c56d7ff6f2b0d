"""The copy of a small local DataFrame (one made on the driver, e.g. ``spark.createDataFrame(pandas_df)``)
written by the driver itself: its rows already live in the driver's memory (a ``LocalRelation``), so
collecting them as Arrow (one small Spark job: no Python worker, no Parquet writer, no commit protocol)
costs less than the Spark job that would write them, which dominates the fit of a few thousand rows.

The rows are those of the same projected DataFrame the Spark writer evaluates (``materialize.prepare``:
stored names and types, the split flag), so the files, their split and the statistics (computed here
with pyarrow, in ``stats.stats_aggs``' form) are what the Spark job would give. Driver side.
"""

import logging
import posixpath
from collections.abc import Sequence
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.specs import ColumnInfo
from hvd_spark._internal.data.store import VAL_COL, Store

logger = logging.getLogger(__name__)


def made_on_driver(df) -> bool:
    """Whether ``df``'s optimized plan is a ``LocalRelation``: rows the driver holds (classic sessions)."""
    try:
        return df._jdf.queryExecution().optimizedPlan().getClass().getSimpleName() == "LocalRelation"
    except Exception:  # noqa: BLE001 - Spark Connect, or no plan to read
        return False


def local_rows(prepared, row_bytes: int) -> int | None:
    """The rows of ``prepared`` when its optimized plan is a ``LocalRelation`` (the driver holds them) of
    at most ``HVD_SPARK_LOCAL_COPY_BYTES`` (estimated at ``row_bytes`` a row: 4 bytes a value, 64 a
    string); None otherwise (a plan that reads
    files or an RDD, a Spark Connect session, a pyspark without ``DataFrame.toArrow``)."""
    limit = settings.LOCAL_COPY_BYTES.get(conf=prepared.sparkSession.conf)
    if not limit or not hasattr(prepared, "toArrow") or not hasattr(prepared, "_jdf"):
        return None
    if not made_on_driver(prepared):
        return None
    try:
        rows = int(prepared._jdf.queryExecution().optimizedPlan().data().size())
    except Exception as e:  # noqa: BLE001 - no plan to read: the Spark writer is always correct
        logger.debug("the DataFrame's plan could not be read (%s): written by a Spark job", e)
        return None
    return rows if rows * max(row_bytes, 1) <= limit else None


def write_local(prepared, store: Store, path: str, n_files: int, group_bytes: int, row_bytes: int):
    """Collects ``prepared`` (a local relation: one small Spark job, no Python worker) and writes each
    split's rows dealt round robin to at most ``n_files`` Parquet files under ``path/train`` and
    ``path/val``, through the store's filesystem. Returns ``(written, table)``: ``(url, rows)`` per
    file and split, as the Spark writer's, and the collected table (for :func:`table_stats`)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = _plain_types(prepared.toArrow())
    flag = table.column(VAL_COL)
    data = table.drop_columns([VAL_COL])
    group_rows = max(1, group_bytes // max(row_bytes, 1))
    written: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    # a null flag (a validation column's, which the statistics count and the fit refuses) is in no split,
    # as with the Spark writers
    for split, mask in (("train", pc.invert(flag)), ("val", flag)):
        rows = data.filter(mask)
        if rows.num_rows == 0:
            continue
        folder = posixpath.join(path, split)
        store.files.makedirs(folder)
        # the Spark writer's round robin: row i to file i % n, each file as long as the others within one row
        files = min(n_files, rows.num_rows)
        for i in range(files):
            part = rows.take(np.arange(i, rows.num_rows, files))
            target = posixpath.join(folder, f"part-{i:05d}.snappy.parquet")
            with store.files.fs.open(target, "wb") as f:
                pq.write_table(part, f, row_group_size=group_rows, compression="snappy")
            written[split].append((store.files.url(target), part.num_rows))
    return written, table


def _plain_types(table):
    """The table with the Arrow types Spark's Parquet writer gives (``string``, ``binary``, ``list``), not
    the large ones ``toArrow`` may use (``spark.sql.execution.arrow.useLargeVarTypes``)."""
    import pyarrow as pa

    def plain(t):
        if pa.types.is_large_string(t):
            return pa.string()
        if pa.types.is_large_binary(t):
            return pa.binary()
        if pa.types.is_large_list(t) or pa.types.is_list(t):  # the element's name and nullability kept
            return pa.list_(t.value_field.with_type(plain(t.value_type)))
        return t

    schema = pa.schema([f.with_type(plain(f.type)) for f in table.schema])
    return table if schema.equals(table.schema) else table.cast(schema)


def table_stats(table, infos: Sequence[ColumnInfo]) -> dict:
    """``stats.stats_from``'s statistics of a collected table: row counts, rows with nulls (or NaNs and
    infinities, elements of arrays included) per column, array lengths, value ranges and fractional
    values over the rows that are not bad (a fit refuses data with bad rows before any rank starts)."""
    import numpy as np
    import pyarrow.compute as pc

    flag = table.column(VAL_COL)
    out: dict[str, Any] = {
        "rows": table.num_rows,
        "val_rows": int(pc.sum(pc.cast(pc.fill_null(flag, False), "int64")).as_py() or 0),
        "val_nulls": flag.null_count,
        "columns": {},
    }
    for info in {i.name: i for i in infos}.values():
        column = table.column(info.stored).combine_chunks()
        s: dict[str, Any] = {"bad": 0, "min_len": None, "max_len": None, "min": None, "max": None, "fractional": 0}
        null = np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        if info.element_type in ("string", "binary"):
            s["bad"] = int(null.sum())
        elif info.kind == "scalar":
            values = column.fill_null(0).to_numpy(zero_copy_only=False)
            bad = null if info.is_integer else null | ~np.isfinite(values.astype("float64"))
            good = values[~bad]
            s["bad"] = int(bad.sum())
            if good.size:
                s.update(min=_number(good.min(), info), max=_number(good.max(), info))
                s["fractional"] = int((good != np.floor(good)).sum()) if good.dtype.kind == "f" else 0
        else:
            s.update(_array_stats(column, null, info))
        out["columns"][info.name] = s
    return out


def _array_stats(column, null, info: ColumnInfo) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    flat = column.flatten()  # the elements of the rows that are not null
    values = flat.fill_null(0).to_numpy(zero_copy_only=False).astype("int64" if info.is_integer else "float64")
    bad_element = np.asarray(flat.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if not info.is_integer:
        bad_element |= ~np.isfinite(values)
    row_of = np.repeat(np.flatnonzero(~null), lengths[~null])
    bad = null.copy()
    bad[row_of[bad_element]] = True
    out: dict[str, Any] = {"bad": int(bad.sum())}
    if (~null).any():
        out.update(min_len=int(lengths[~null].min()), max_len=int(lengths[~null].max()))
    kept = values[~bad[row_of]] if values.size else values
    if kept.size:
        out.update(min=_number(kept.min(), info), max=_number(kept.max(), info))
    return out


def _number(x, info: ColumnInfo):
    return int(x) if info.is_integer else float(x)
