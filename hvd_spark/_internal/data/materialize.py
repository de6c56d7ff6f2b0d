"""Driver side of the data path: check a DataFrame against the model, write it to the store.

Everything here runs Spark jobs; nothing is collected to the driver but counts and
per-column statistics, so data larger than the driver's memory works. The exception is a small
DataFrame whose rows the driver holds already (a local relation): ``local_copy.py`` writes it.
"""

import contextlib
import functools
import logging
import operator
import posixpath
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.secrets import url_without_credentials
from hvd_spark._internal.common.sources import stored_dtype
from hvd_spark._internal.common.specs import (
    ColumnInfo,
    group_name,
)
from hvd_spark._internal.data import leases
from hvd_spark._internal.data.jobs import spark_job
from hvd_spark._internal.data.local_copy import local_rows, table_stats, write_local
from hvd_spark._internal.data.stats import column_stats, stats_aggs, stats_from
from hvd_spark._internal.data.store import DATA_META, DATA_USED, FORMAT_VERSION, VAL_COL, Store, data_path, job_config

logger = logging.getLogger(__name__)

META_NAME = DATA_META


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
    if isinstance(dtype, T.StringType) and role == "feature":  # for a model input of dtype "string"
        return ColumnInfo(name, "scalar", "string", False)
    if isinstance(dtype, T.BinaryType) and role == "feature":  # bytes (an image): decoded by transformation_fn
        return ColumnInfo(name, "binary", "binary", False)
    strings = (
        " Strings feed model inputs of dtype 'string' (StringLookup, TextVectorization, Hashing) as features "
        "only; index a string label with pyspark.ml.feature.StringIndexer."
        if isinstance(dtype, T.StringType)
        else ""
    )
    also = " (or a string or binary column for a feature)" if role == "feature" else ""
    raise TypeError(
        f"{role} column '{name}' has type {dtype.simpleString()}. Expected a numeric column, an array "
        f"of numbers, or a Vector (pyspark.ml.linalg){also}.{strings}"
    )


def _group_info(df, parts: list[str], role: str) -> ColumnInfo:
    tensor = "output" if role == "label" else "input"  # label_cols stack into one output's label
    if len(set(parts)) != len(parts):
        raise ValueError(f"{role} columns {parts} are stacked into one {tensor}; each may appear once.")
    infos = [column_info(df, p, role) for p in parts]
    binary = [i.name for i in infos if i.kind == "binary"]
    if binary:
        raise TypeError(
            f"{role} columns {group_name(parts)} are stacked into one array of numbers; {binary} hold bytes. Give a "
            "binary column a model input of its own (decoded by transformation_fn)."
        )
    strings = [i.name for i in infos if i.element_type == "string"]
    if strings:
        raise TypeError(
            f"{role} columns {group_name(parts)} are stacked into one array of numbers; {strings} hold strings. "
            "Give a string column a model input of its own (dtype 'string')."
        )
    arrays = [i.name for i in infos if i.kind != "scalar"]
    if arrays:
        raise TypeError(
            f"{role} columns {group_name(parts)} are stacked into one model {tensor}, which needs one "
            f"value per column; {arrays} hold several values per row. Stack scalar columns only, or "
            f"give each array / Vector column its own {tensor}."
        )
    integer = all(i.is_integer for i in infos)
    element = ("bigint" if any(i.element_type == "bigint" for i in infos) else "int") if integer else "float"
    return ColumnInfo(group_name(parts), "array", element, integer, parts=tuple(parts))


def feature_expr(info: ColumnInfo, element: str | None = None):
    """The Spark expression of one feature as an array (or a scalar): Vectors turned into float arrays,
    a group of scalar columns stacked into one array of ``element`` (default: bigint for integers, so
    no id is truncated; float otherwise), null when any of them is null."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if info.parts:
        element = element or ("bigint" if info.is_integer else "float")
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


_SPARK_TYPE = {"int32": "int", "int64": "bigint", "float32": "float"}


def stored_element(info: ColumnInfo) -> str:
    """The Spark type an array or a group is stored with: ``sources.stored_dtype``'s (bigint for
    arrays and groups of bigint, so that 64-bit ids are kept whole; int for other integers; float)."""
    return _SPARK_TYPE[stored_dtype("group" if info.parts else info.kind, info.element_type, info.is_integer)]


def _as_stored(info: ColumnInfo):
    """The column as it is written to Parquet, under its stored name: vectors become float arrays
    on the JVM side, integer arrays int (bigint when their elements are), booleans ints, decimals
    doubles."""
    from pyspark.ml.functions import vector_to_array

    if info.parts:  # nulls inside stay elements of the array: check_stats names the group
        from pyspark.sql import functions as F

        return F.array(*[col(p).cast(stored_element(info)) for p in info.parts]).alias(info.stored)
    c = col(info.name)
    if info.kind == "vector":
        c = vector_to_array(c, "float32")
    elif info.kind == "array":
        c = c.cast(f"array<{stored_element(info)}>")
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
        return df.select(*cols)
    out = df.select(*cols)
    if validation:
        return out.withColumn(VAL_COL, split_flag([F.col(c) for c in out.columns], float(validation), seed))
    return out.withColumn(VAL_COL, F.lit(False))


HASH_BUCKETS = 1 << 30


def split_flag(columns: list, fraction: float, seed: int):
    """Whether a row goes to the validation split: a seeded hash of the row's values (the columns
    that are written), below ``fraction``. It depends on the row's content only, never on its
    position, partition or the order rows arrive in, so every evaluation of the data (on any
    cluster, after any shuffle) splits it the same way; identical rows land in the same split."""
    from pyspark.sql import functions as F

    bucket = F.pmod(F.xxhash64(*columns, F.lit(int(seed))), F.lit(HASH_BUCKETS))
    return bucket < F.lit(int(round(fraction * HASH_BUCKETS)))


def num_files(num_proc: int, slots: int) -> int:
    """Files per split: a multiple of ``num_proc`` (ranks get equal shares: the rows are dealt round
    robin), as many as the application's task slots (the write runs on all of them), at most about
    ``HVD_SPARK_MAX_FILES`` (default 256)."""
    return num_proc * max(1, min(slots, settings.MAX_FILES.get()) // max(1, num_proc))


def _write_through_store(
    df, store: Store, path: str, row_bytes: int, group_bytes: int
) -> dict[str, list[tuple[str, int]]]:
    """Writes each partition of ``df`` as Parquet under ``path/train`` and ``path/val`` (by its split
    flag) from its Spark task, through the store's own filesystem (fsspec, with its storage options):
    for stores that Spark's Hadoop filesystems cannot reach (``s3://`` without the Hadoop AWS jars or
    credentials).

    Each task attempt writes its own file names (an object appears whole when its upload closes);
    the driver keeps the files of the attempts Spark returned and removes the others (a task
    attempt that failed or lost a speculative race). Returns ``(url, rows)`` per file and split."""
    config = job_config(store)
    group_rows = max(1, group_bytes // max(row_bytes, 1))

    def write(batches):
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # a Spark task
        task_store = Store.from_config(config)
        tag = f"{ctx.partitionId():05d}-{ctx.attemptNumber()}-{uuid.uuid4().hex[:8]}"
        pending: dict[str, list] = {"train": [], "val": []}
        rows = {"train": 0, "val": 0}
        targets = {split: posixpath.join(path, split, f"part-{tag}.snappy.parquet") for split in rows}
        with contextlib.ExitStack() as stack:
            writers: dict[str, Any] = {}

            def flush(split: str) -> None:
                if pending[split]:
                    writers[split].write_table(pa.Table.from_batches(pending[split]), row_group_size=group_rows)
                    pending[split] = []

            for batch in batches:
                flag = batch.column(batch.schema.get_field_index(VAL_COL))
                keep = [i for i, name in enumerate(batch.schema.names) if name != VAL_COL]
                data = pa.RecordBatch.from_arrays(
                    [batch.column(i) for i in keep], names=[batch.schema.names[i] for i in keep]
                )
                for split, mask in (("val", flag), ("train", pc.invert(flag))):
                    part = data.filter(mask)
                    if part.num_rows == 0:
                        continue
                    if split not in writers:
                        task_store.files.makedirs(posixpath.dirname(targets[split]))
                        f = stack.enter_context(task_store.files.fs.open(targets[split], "wb"))
                        writers[split] = stack.enter_context(pq.ParquetWriter(f, part.schema, compression="snappy"))
                    pending[split].append(part)
                    rows[split] += part.num_rows
                    if sum(b.num_rows for b in pending[split]) >= group_rows:
                        flush(split)
            for split in writers:
                flush(split)
        written = [(split, targets[split], rows[split]) for split in ("train", "val") if rows[split]]
        if written:
            yield pa.RecordBatch.from_pydict(
                {"split": [w[0] for w in written], "file": [w[1] for w in written], "rows": [w[2] for w in written]}
            )

    returned = df.mapInArrow(write, "split string, file string, rows long").collect()
    out: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    for r in returned:
        out[r["split"]].append((r["file"], int(r["rows"])))
    for split, files in out.items():  # files of task attempts that Spark did not keep
        kept = {posixpath.basename(f) for f, _ in files}
        folder = posixpath.join(path, split)
        for name in store.files.listdir(folder):
            if name not in kept:
                store.files.rm(posixpath.join(folder, name))
        out[split] = sorted((store.files.url(f), rows) for f, rows in files)
    return out


def _parquet_files(store: Store, path: str) -> list[tuple[str, int]]:
    import pyarrow.parquet as pq

    out = []
    for name in store.files.listdir(path):
        if name.endswith(".parquet") and not name.startswith(("_", ".")):
            full = posixpath.join(path, name)
            with store.files.fs.open(full, "rb") as f:
                out.append((store.files.url(full), pq.ParquetFile(f).metadata.num_rows))
    return out


def _usable(meta: dict | None, num_proc: int) -> TypeGuard[dict]:
    """Whether published data can feed ``num_proc`` ranks with a file each (or has fewer rows than ranks)."""
    return meta is not None and (len(meta["train_files"]) >= num_proc or meta["train_rows"] < num_proc)


def _read_meta(store: Store, path: str) -> dict | None:
    try:
        return store.files.read_json(path)
    except FileNotFoundError:
        return None


def materialize(
    prepared,
    store: Store,
    key: str,
    infos: Sequence[ColumnInfo],
    row_bytes: int,
    num_proc: int,
    *,
    check: Callable[[dict], None] | None = None,
    files: int | None = None,
    wait: float | None = None,
) -> dict:
    """Writes train / validation Parquet under ``data/<key>`` (or reuses it) and returns its metadata.

    One Spark job evaluates ``prepared`` once and writes both splits (by its split flag), ``files``
    files each (default ``num_proc``); the statistics of ``infos`` (:func:`stats_aggs`) are computed
    in the same pass and kept in the metadata (``"stats"``). ``check(stats)`` raises for data that
    cannot be trained on: it runs on reused data's statistics, and on new data before publication,
    whose files are then removed. Row counts are those of the files written. A small ``prepared``
    whose rows the driver holds (a local relation) is written by the driver (``local_copy.py``): the
    same files per split, the same statistics.

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
    from hvd_spark._internal.common import settings

    wait = settings.MATERIALIZE_WAIT.get(wait)
    folder = data_path(store, key)
    meta_path = posixpath.join(folder, META_NAME)
    deadline, last_log = time.monotonic() + wait, 0.0
    while True:
        meta = _read_meta(store, meta_path)
        if _usable(meta, num_proc):
            if check is not None:
                check(meta["stats"])
            with contextlib.suppress(Exception):  # only for Store.cleanup's age: never fails a fit
                store.files.write_json(posixpath.join(folder, DATA_USED), {"time": time.time()})
            logger.info(
                "reusing materialized data %s (%d train / %d val rows)", key, meta["train_rows"], meta["val_rows"]
            )
            return meta
        writers = leases.live_leases(store.files, folder, _LEASE_PREFIX, settings.LEASE_STALE)
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
        with leases.lease(
            store.files,
            posixpath.join(folder, f"{_LEASE_PREFIX}{attempt}.json"),
            settings.LEASE_HEARTBEAT,
            key=key,
            attempt=attempt,
        ):
            return _write_attempt(
                prepared, store, key, attempt, infos, row_bytes, num_proc, files or num_proc, check, meta is not None
            )
    except BaseException:
        with contextlib.suppress(Exception):  # the store may be what failed: the original error matters
            if not store.files.listdir(folder):  # nothing of this key is left: leave no empty folder either
                store.files.rm(folder)
        raise


_LEASE_PREFIX = "_writing-"
_COMPLETE = "_complete"


def _who(leases: list[dict]) -> str:
    return ", ".join(f"a fit on host {d.get('host')} (pid {d.get('pid')})" for d in leases)


def _remove_dead_attempts(store: Store, folder: str, meta: dict | None) -> None:
    """Removes attempt folders of writers that died: not complete and without a live lease.

    Complete attempts are kept even when not published (a fit may be reading them).
    """
    from hvd_spark._internal.common import settings

    names = store.files.listdir(folder)
    live = {d.get("attempt") for d in leases.live_leases(store.files, folder, _LEASE_PREFIX, settings.LEASE_STALE)}
    for name in names:
        if not name.startswith("a-") or name in live or (meta and meta.get("attempt") == name):
            continue
        path = posixpath.join(folder, name)
        if not store.files.exists(posixpath.join(path, _COMPLETE)):
            logger.info("removing %s, left incomplete by a fit that stopped while writing it", store.files.url(path))
            store.files.rm(path)
    for name in names:  # leases whose writer is gone
        if name.startswith(_LEASE_PREFIX) and name[len(_LEASE_PREFIX) : -len(".json")] not in live:
            store.files.rm(posixpath.join(folder, name))


def _observed(observation, infos: Sequence[ColumnInfo], prepared, store: Store, written: dict) -> dict:
    """The statistics observed while writing; where the session cannot observe (Spark Connect on
    pyspark 3.5, lost observed metrics), computed from the files written (local and Hadoop stores)
    or, for object stores, from a second pass over the input (with a warning)."""
    try:
        return stats_from(observation.get, infos)
    except Exception as e:  # noqa: BLE001 - any failure to observe: the fallback below
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    from pyspark.sql import functions as F

    spark = prepared.sparkSession
    if store.spark_writes and (written["train"] or written["val"]):
        logger.info("statistics of the written files (the session could not observe them: %s)", reason)
        with spark_job(f"reading the training data written to {url_without_credentials(store.prefix)} (statistics)"):
            parts = [
                spark.read.parquet(*[u for u, _ in written[split]]).withColumn(VAL_COL, F.lit(split == "val"))
                for split in ("train", "val")
                if written[split]
            ]
            frame = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
            return stats_from(frame.agg(*stats_aggs(infos)).collect()[0].asDict(), infos)
    logger.warning("the session could not observe the data's statistics (%s): computing them in a second pass", reason)
    with spark_job("computing the statistics of the training data (a second pass over the DataFrame)"):
        return column_stats(prepared, infos)


def _write_attempt(
    prepared,
    store: Store,
    key: str,
    attempt: str,
    infos: Sequence[ColumnInfo],
    row_bytes: int,
    num_proc: int,
    n_files: int,
    check: Callable[[dict], None] | None,
    replace: bool,
) -> dict:
    from pyspark.sql import Observation

    t0 = time.time()
    folder = data_path(store, key)
    path = posixpath.join(folder, attempt)
    try:
        # A Parquet writer holds its row group in memory until it is full, outside Spark's memory
        # manager: row groups of a bounded size (64 MB by default) keep each task's writers, and the
        # ranks that read a row group whole, at a memory independent of the data's size (256 MB row
        # groups ran the 1 GiB heap of a local session out of memory at 20M rows).
        group_bytes = settings.ROW_GROUP_BYTES.get(conf=prepared.sparkSession.conf)
        if local_rows(prepared, row_bytes) is not None:  # rows the driver holds: written by the driver
            with spark_job("collecting the training data on the driver"):
                written, table = write_local(prepared, store, path, n_files, group_bytes, row_bytes)
            return _finish(store, key, path, table_stats(table, infos), written, num_proc, check, replace, t0)
        # Rows are dealt round robin (a local sort first makes that deterministic on a retry), and the
        # statistics are observed in the writing stage itself: one evaluation of the input.
        observation = Observation(f"hvd_spark_{attempt.replace('-', '_')}")
        part = prepared.repartition(n_files).observe(observation, *stats_aggs(infos))
        target = url_without_credentials(store.files.url(path))
        with spark_job(f"writing the training data to {target}"):  # the Spark writer, or each task through the store
            if store.spark_writes:
                (
                    part.write.mode("error")
                    .partitionBy(VAL_COL)
                    .option("parquet.block.size", group_bytes)
                    .option("compression", "snappy")
                    .parquet(store.files.url(path))
                )
                written = {
                    split: _parquet_files(store, posixpath.join(path, f"{VAL_COL}={flag}"))
                    for split, flag in (("train", "false"), ("val", "true"))
                }
            else:
                written = _write_through_store(part, store, path, row_bytes, group_bytes)
        stats = _observed(observation, infos, prepared, store, written)
        return _finish(store, key, path, stats, written, num_proc, check, replace, t0)
    except BaseException:  # not published (``_publish`` raises only before it publishes)
        with contextlib.suppress(Exception):  # unreachable store: the next writer removes the attempt
            store.files.rm(path)
        raise


def _finish(
    store: Store,
    key: str,
    path: str,
    stats: dict,
    written: dict,
    num_proc: int,
    check: Callable[[dict], None] | None,
    replace: bool,
    t0: float,
) -> dict:
    """Checks the statistics of the attempt written at ``path`` and publishes it (see ``_publish``); the
    caller removes the attempt when this raises."""
    rows = {split: sum(r for _, r in files) for split, files in written.items()}
    if rows["train"] + rows["val"] != stats["rows"]:  # a task counted twice (observed metrics of a retry)
        logger.warning(
            "the statistics of data %s count %d rows, its files hold %d; the files' counts are used",
            key,
            stats["rows"],
            rows["train"] + rows["val"],
        )
    if check is not None:
        check(stats)
    meta = {
        "key": key,
        "attempt": posixpath.basename(path),
        "train_rows": rows["train"],
        "val_rows": rows["val"],
        "train_files": [[p, r] for p, r in written["train"]],
        "val_files": [[p, r] for p, r in written["val"]],
        "stats": stats,
        "format": FORMAT_VERSION,
        "created": time.time(),
    }
    other = _publish(store, key, path, meta, num_proc, replace)
    if other is not None:
        return other
    logger.info(
        "materialized %d train / %d val rows to %s in %.1fs (one pass over the input)",
        meta["train_rows"],
        meta["val_rows"],
        store.files.url(path),
        time.time() - t0,
    )
    return meta


def _publish(store: Store, key: str, path: str, meta: dict, num_proc: int, replace: bool) -> dict | None:
    """Marks the attempt at ``path`` complete and publishes ``meta`` (its files) as the data of ``key``.
    Returns None once it is published, or the metadata of another fit that published the same data
    first (usable by ``num_proc`` ranks), whose files are then used and this attempt's removed. An
    error before publication is raised (the caller removes the attempt)."""
    meta_path = posixpath.join(data_path(store, key), META_NAME)
    store.files.write_bytes(posixpath.join(path, _COMPLETE), b"")
    if replace:  # the published data had too few files: replace it (its files stay for its readers)
        store.files.write_json(meta_path, meta)
        return None
    if store.files.create_exclusive_json(meta_path, meta):
        return None
    other = _read_meta(store, meta_path)  # another fit published the same data first: use that and drop ours
    if _usable(other, num_proc):
        logger.info("another fit wrote data %s first; using its files", key)
        store.files.rm(path)
        return other
    store.files.write_json(meta_path, meta)
    return None
