"""Driver side of the data path: check a DataFrame against the model, write it to the store.

Everything here runs Spark jobs; nothing is collected to the driver but counts and
per-column statistics, so data larger than the driver's memory works.
"""

import contextlib
import functools
import hashlib
import json
import logging
import math
import operator
import posixpath
import time
import uuid
from collections.abc import Sequence
from typing import Any, TypeGuard

from hvd_spark._internal.specs import (
    ColumnInfo,
    TensorSpec,
    check_feature_lengths,
    check_label_lengths,
    group_name,
)
from hvd_spark._internal.store import Store

logger = logging.getLogger("hvd_spark")

VAL_COL = "__hvd_spark_is_val"
META_NAME = "_hvd_spark_meta.json"
FORMAT_VERSION = 2  # 2: attempt folders under data/<key>/, stored column names
TARGET_FILE_BYTES = 32 * 1024 * 1024


def column_info(df, name, role: str) -> ColumnInfo:
    """Classifies a column as scalar / array / vector, or raises a TypeError naming it. ``name`` may
    be a list of scalar columns: one array of them, stacked in that order."""
    if not isinstance(name, str):
        return _group_info(df, list(name), role)
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import types as T

    if name not in df.columns:
        raise ValueError(f"{role} column '{name}' is not in the DataFrame. Available columns: {df.columns}.")
    dtype = df.schema[name].dataType
    numeric = (
        T.ByteType,
        T.ShortType,
        T.IntegerType,
        T.LongType,
        T.FloatType,
        T.DoubleType,
        T.DecimalType,
        T.BooleanType,
    )
    integer = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)
    if isinstance(dtype, numeric):
        return ColumnInfo(name, "scalar", dtype.simpleString(), isinstance(dtype, integer))
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, numeric):
        return ColumnInfo(name, "array", dtype.elementType.simpleString(), isinstance(dtype.elementType, integer))
    if isinstance(dtype, (VectorUDT, OldVectorUDT)):
        return ColumnInfo(name, "vector", "double", False)
    raise TypeError(
        f"{role} column '{name}' has type {dtype.simpleString()}. Expected a numeric column, an array "
        "of numbers, or a Vector (pyspark.ml.linalg)."
    )


def _group_info(df, parts: list[str], role: str) -> ColumnInfo:
    if len(set(parts)) != len(parts):
        raise ValueError(f"{role} columns {parts} are stacked into one input; each may appear once.")
    infos = [column_info(df, p, role) for p in parts]
    arrays = [i.name for i in infos if i.kind != "scalar"]
    if arrays:
        raise TypeError(
            f"{role} columns {group_name(parts)} are stacked into one model input, which needs one "
            f"value per column; {arrays} hold several values per row. Stack scalar columns only, or "
            "give each array / Vector column its own input."
        )
    integer = all(i.is_integer for i in infos)
    return ColumnInfo(group_name(parts), "array", "int" if integer else "float", integer, parts=tuple(parts))


def feature_expr(info: ColumnInfo, element: str = "float"):
    """The Spark expression of one feature as an array (or a scalar) of ``element``: Vectors turned into
    arrays, a group of scalar columns stacked into one array (null when any of them is null)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if info.parts:
        stacked = F.array(*[col(p).cast(element) for p in info.parts])
        return F.when(functools.reduce(operator.or_, [col(p).isNull() for p in info.parts]), F.lit(None)).otherwise(
            stacked
        )
    c = col(info.name)
    return vector_to_array(c, "float32") if info.kind == "vector" else c


def col(name: str):
    """A reference to the top-level column ``name``, whatever characters it holds (``x.y``, ``a b``)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def _as_stored(info: ColumnInfo):
    """The column as it is written to Parquet, under its stored name: vectors become float arrays
    on the JVM side, booleans ints, decimals doubles."""
    from pyspark.ml.functions import vector_to_array

    if info.parts:  # nulls inside stay elements of the array: check_stats names the group
        from pyspark.sql import functions as F

        return F.array(*[col(p).cast("int" if info.is_integer else "float") for p in info.parts]).alias(info.stored)
    c = col(info.name)
    if info.kind == "vector":
        c = vector_to_array(c, "float32")
    elif info.kind == "array":
        c = c.cast(f"array<{'int' if info.is_integer else 'float'}>")
    elif info.element_type == "boolean":
        c = c.cast("int")
    elif info.element_type.startswith("decimal"):
        c = c.cast("double")
    return c.alias(info.stored)


def prepare(
    df, features: Sequence[ColumnInfo], labels: Sequence[ColumnInfo], weight: ColumnInfo | None, validation, seed: int
):
    """The projected DataFrame that is checked and written: the needed columns only, under their
    stored names (see ``specs.with_stored_names``), plus the split flag."""
    from pyspark.sql import functions as F

    cols, seen = [], set()
    for info in [*features, *labels]:
        if info.stored not in seen:  # the same column can be a feature and a label
            seen.add(info.stored)
            cols.append(_as_stored(info))
    if weight is not None and weight.stored not in seen:
        cols.append(col(weight.name).cast("float").alias(weight.stored))
    if isinstance(validation, str):
        v = col(validation)
        if dict(df.dtypes)[validation] == "boolean":
            cols.append(v.alias(VAL_COL))
        else:  # 1 / 0; anything else becomes null and is reported by check_stats
            cols.append(F.when(v == 1, F.lit(True)).when(v == 0, F.lit(False)).alias(VAL_COL))
    elif validation:
        cols.append((F.rand(seed) < float(validation)).alias(VAL_COL))
    else:
        cols.append(F.lit(False).alias(VAL_COL))
    return df.select(*cols)


def column_stats(prepared, infos: Sequence[ColumnInfo], validation) -> dict:
    """One Spark job: row counts, nulls / NaNs per column, array lengths, validation flag range."""
    from pyspark.sql import functions as F

    aggs = [
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.col(VAL_COL).cast("int")).alias("val_rows"),
        F.sum(F.col(VAL_COL).isNull().cast("int")).alias("val_nulls"),
    ]
    unique = list({i.name: i for i in infos}.values())
    for i, info in enumerate(unique):
        c = F.col(info.stored)
        if info.kind == "scalar":
            bad = c.isNull() | (F.isnan(c.cast("double")) if not info.is_integer else F.lit(False))
            aggs += [
                F.sum(bad.cast("int")).alias(f"bad_{i}"),
                F.lit(None).alias(f"min_{i}"),
                F.lit(None).alias(f"max_{i}"),
            ]
        else:
            bad = c.isNull() | F.exists(c, lambda x: x.isNull() | F.isnan(x.cast("double")))
            aggs += [
                F.sum(bad.cast("int")).alias(f"bad_{i}"),
                F.min(F.size(c)).alias(f"min_{i}"),
                F.max(F.size(c)).alias(f"max_{i}"),
            ]
    row = prepared.agg(*aggs).collect()[0].asDict()
    out: dict[str, Any] = {
        "rows": row["rows"] or 0,
        "val_rows": row["val_rows"] or 0,
        "val_nulls": row["val_nulls"] or 0,
        "columns": {},
    }
    for i, info in enumerate(unique):
        out["columns"][info.name] = {
            "bad": row[f"bad_{i}"] or 0,
            "min_len": row[f"min_{i}"],
            "max_len": row[f"max_{i}"],
        }
    return out


def check_stats(
    stats: dict,
    features: Sequence[ColumnInfo],
    labels: Sequence[ColumnInfo],
    weight: ColumnInfo | None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    validation,
    num_proc: int,
) -> None:
    """Raises ValueError for the first problem in the statistics (before anything is written)."""
    rows = stats["rows"]
    if rows == 0:
        raise ValueError(
            "The DataFrame passed to fit() is empty: 0 rows. Expected at least one row per process "
            f"(num_proc={num_proc})."
        )
    for role, infos in (("feature", features), ("label", labels), ("sample weight", [weight] if weight else [])):
        for info in infos:
            bad = stats["columns"][info.name]["bad"]
            if bad:
                raise ValueError(
                    f"{role.capitalize()} column '{info.name}' has {bad} of {rows} rows with null or "
                    "NaN values. Remove or fill them before fit (e.g. df.dropna() / df.fillna())."
                )
    for info, spec in zip(features, inputs):
        s = stats["columns"][info.name]
        check_feature_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind)
    for info, spec in zip(labels, outputs):
        s = stats["columns"][info.name]
        check_label_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind)
    if isinstance(validation, str) and stats["val_nulls"]:
        raise ValueError(
            f"validation column '{validation}' has {stats['val_nulls']} rows that are null or not 0/1. "
            "Expected true/false or 1/0 in every row."
        )
    val_rows, train_rows = stats["val_rows"], rows - stats["val_rows"]
    if validation and val_rows == 0:
        raise ValueError(
            f"The validation split is empty (validation={validation!r} selected 0 of {rows} rows). "
            "Raise the fraction, mark some rows in the validation column, or set validation=None."
        )
    if train_rows == 0:
        raise ValueError(f"The training split is empty: all {rows} rows went to validation ({validation!r}).")


def dataset_key(df, infos: Sequence[ColumnInfo], validation, seed: int) -> str:
    """Identifies a materialization: the DataFrame's query plan, the columns and the split."""
    spec = {
        "plan": df.semanticHash(),
        "columns": [i.to_dict() for i in infos],
        "validation": validation,
        "seed": seed if validation and not isinstance(validation, str) else None,
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def _num_files(rows: int, row_bytes: int, num_proc: int) -> int:
    by_size = math.ceil(rows * max(row_bytes, 1) / TARGET_FILE_BYTES)
    n = max(num_proc, by_size)
    return min(max(1, rows), math.ceil(n / num_proc) * num_proc)


ROW_GROUP_BYTES = 64 * 1024 * 1024  # row groups of the Parquet that tasks write through the store


def _write_through_store(df, store: Store, path: str, row_bytes: int) -> list[tuple[str, int]]:
    """Writes each partition of ``df`` as one Parquet file under ``path`` from its Spark task,
    through the store's own filesystem (fsspec, with its storage options): for stores that Spark's
    Hadoop filesystems cannot reach (``s3://`` without the Hadoop AWS jars or credentials).

    Each task attempt writes its own file name (an object appears whole when its upload closes);
    the driver keeps the files of the attempts Spark returned and removes the others (a task
    attempt that failed or lost a speculative race). Returns ``(url, rows)`` per file."""
    config = store.to_config()
    group_rows = max(1, ROW_GROUP_BYTES // max(row_bytes, 1))

    def write(batches):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        task_store = Store.from_config(config)
        name = f"part-{ctx.partitionId():05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex[:8]}.snappy.parquet"
        target = posixpath.join(path, name)
        pending: list = []
        rows = 0
        with contextlib.ExitStack() as stack:
            writer = None
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if writer is None:
                    f = stack.enter_context(task_store._fs.open(target, "wb"))
                    writer = stack.enter_context(pq.ParquetWriter(f, batch.schema, compression="snappy"))
                pending.append(batch)
                rows += batch.num_rows
                if sum(b.num_rows for b in pending) >= group_rows:
                    writer.write_table(pa.Table.from_batches(pending), row_group_size=group_rows)
                    pending = []
            if pending and writer is not None:
                writer.write_table(pa.Table.from_batches(pending), row_group_size=group_rows)
        if rows:
            yield pa.RecordBatch.from_pydict({"file": [target], "rows": [rows]})

    written = [(r["file"], int(r["rows"])) for r in df.mapInArrow(write, "file string, rows long").collect()]
    kept = {posixpath.basename(f) for f, _ in written}
    for name in store._listdir(path):  # files of task attempts that Spark did not keep
        if name not in kept:
            store._rm(posixpath.join(path, name))
    return sorted((store._url(f), rows) for f, rows in written)


def _parquet_files(store: Store, path: str) -> list[tuple[str, int]]:
    import pyarrow.parquet as pq

    out = []
    for name in store._listdir(path):
        if name.endswith(".parquet") and not name.startswith(("_", ".")):
            full = posixpath.join(path, name)
            with store._fs.open(full, "rb") as f:
                out.append((store._url(full), pq.ParquetFile(f).metadata.num_rows))
    return out


def _usable(meta: dict | None, num_proc: int) -> TypeGuard[dict]:
    """Whether published data can feed ``num_proc`` ranks with a file each (or has fewer rows than ranks)."""
    return meta is not None and (len(meta["train_files"]) >= num_proc or meta["train_rows"] < num_proc)


def _read_meta(store: Store, path: str) -> dict | None:
    try:
        return store._read_json(path)
    except FileNotFoundError:
        return None


def materialize(
    prepared, store: Store, key: str, stats: dict, row_bytes: int, num_proc: int, wait: float | None = None
) -> dict:
    """Writes train / validation Parquet under ``data/<key>`` (or reuses it) and returns its metadata.

    Safe when several fits (threads, processes, other drivers) materialize into one store:

    * each write goes to its own attempt folder ``data/<key>/<attempt>/`` and is published by
      writing ``data/<key>/_hvd_spark_meta.json``, which names the attempt's files; published
      files are never deleted or replaced, so a fit never loses files it is reading;
    * a writer holds a lease (``data/<key>/_writing-<attempt>.json``, a heartbeat every 10 s);
      a fit that finds a live lease and no usable metadata waits for it (up to ``wait``
      seconds, default ``HVD_SPARK_MATERIALIZE_WAIT`` or 1 hour) and then reuses the result;
    * when two writers finish together, the first to publish wins and the other removes its
      own copy (on object stores, where publication is not exclusive, both copies stay valid);
    * a writer that dies leaves an attempt folder without a ``_complete`` marker and a lease
      whose heartbeat stops; the next writer of that key removes such folders.
    """
    from hvd_spark._internal import settings

    wait = settings.seconds_setting(
        wait, settings.ENV_MATERIALIZE_WAIT, None, settings.DEFAULT_MATERIALIZE_WAIT, "materialize_wait"
    )
    folder = store._data_path(key)
    meta_path = posixpath.join(folder, META_NAME)
    deadline, last_log = time.monotonic() + wait, 0.0
    while True:
        meta = _read_meta(store, meta_path)
        if _usable(meta, num_proc):
            logger.info(
                "reusing materialized data %s (%d train / %d val rows)", key, meta["train_rows"], meta["val_rows"]
            )
            return meta
        writers = store._live_leases(folder, _LEASE_PREFIX, settings.LEASE_STALE)
        if not writers or time.monotonic() > deadline:
            if writers:
                logger.warning(
                    "gave up waiting after %.0fs for %s writing data %s; writing it again", wait, _who(writers), key
                )
            break
        if time.monotonic() - last_log > 30:
            logger.info("waiting for %s, which is writing the same data (%s) to the store", _who(writers), key)
            last_log = time.monotonic()
        time.sleep(1.0)
    if meta is not None:
        logger.info("materialized data %s has too few files for %d processes; writing it again", key, num_proc)
    _remove_dead_attempts(store, folder, meta)
    attempt = f"a-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    try:
        with store._lease(
            posixpath.join(folder, f"{_LEASE_PREFIX}{attempt}.json"), settings.LEASE_HEARTBEAT, key=key, attempt=attempt
        ):
            return _write_attempt(prepared, store, key, attempt, stats, row_bytes, num_proc, replace=meta is not None)
    except BaseException:
        with contextlib.suppress(Exception):  # the store may be what failed: the original error matters
            if not store._listdir(folder):  # nothing of this key is left: leave no empty folder either
                store._rm(folder)
        raise


_LEASE_PREFIX = "_writing-"
_COMPLETE = "_complete"


def _who(leases: list[dict]) -> str:
    return ", ".join(f"a fit on host {d.get('host')} (pid {d.get('pid')})" for d in leases)


def _remove_dead_attempts(store: Store, folder: str, meta: dict | None) -> None:
    """Removes attempt folders of writers that died: not complete and without a live lease.

    Complete attempts are kept even when not published (a fit may be reading them).
    """
    from hvd_spark._internal import settings

    names = store._listdir(folder)
    live = {d.get("attempt") for d in store._live_leases(folder, _LEASE_PREFIX, settings.LEASE_STALE)}
    for name in names:
        if not name.startswith("a-") or name in live or (meta and meta.get("attempt") == name):
            continue
        path = posixpath.join(folder, name)
        if not store._exists(posixpath.join(path, _COMPLETE)):
            logger.info("removing %s, left incomplete by a fit that stopped while writing it", store._url(path))
            store._rm(path)
    for name in names:  # leases whose writer is gone
        if name.startswith(_LEASE_PREFIX) and name[len(_LEASE_PREFIX) : -len(".json")] not in live:
            store._rm(posixpath.join(folder, name))


def _write_attempt(
    prepared, store: Store, key: str, attempt: str, stats: dict, row_bytes: int, num_proc: int, replace: bool
) -> dict:
    from pyspark.sql import functions as F

    t0 = time.time()
    folder = store._data_path(key)
    path = posixpath.join(folder, attempt)
    meta_path = posixpath.join(folder, META_NAME)
    train_rows, val_rows = stats["rows"] - stats["val_rows"], stats["val_rows"]
    published = False
    try:
        meta = {
            "key": key,
            "attempt": attempt,
            "train_rows": train_rows,
            "val_rows": val_rows,
            "format": FORMAT_VERSION,
            "created": time.time(),
        }
        for split, rows, cond in (("train", train_rows, ~F.col(VAL_COL)), ("val", val_rows, F.col(VAL_COL))):
            files = []
            if rows:
                n = _num_files(rows, row_bytes, num_proc)
                split_path = posixpath.join(path, split)
                part = prepared.filter(cond).drop(VAL_COL).repartition(n)
                if store.spark_writes:
                    (
                        part.write.mode("error")
                        .option("parquet.block.size", 256 * 1024 * 1024)
                        .option("compression", "snappy")
                        .parquet(store._url(split_path))
                    )
                    files = _parquet_files(store, split_path)
                else:
                    files = _write_through_store(part, store, split_path, row_bytes)
            meta[f"{split}_files"] = [[p, r] for p, r in files]
        store._write_bytes(posixpath.join(path, _COMPLETE), b"")
        if replace:  # the published data had too few files: replace it (its files stay for its readers)
            store._write_json(meta_path, meta)
            published = True
        else:
            published = store._create_exclusive_json(meta_path, meta)
            if not published:  # another fit published the same data first: use that and drop ours
                other = _read_meta(store, meta_path)
                if _usable(other, num_proc):
                    logger.info("another fit wrote data %s first; using its files", key)
                    store._rm(path)
                    return other
                store._write_json(meta_path, meta)
                published = True
    except BaseException:
        if not published:
            with contextlib.suppress(Exception):  # unreachable store: the next writer removes the attempt
                store._rm(path)
        raise
    logger.info(
        "materialized %d train / %d val rows to %s in %.1fs", train_rows, val_rows, store._url(path), time.time() - t0
    )
    return meta
