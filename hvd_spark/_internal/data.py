"""Driver side of the data path: check a DataFrame against the model, write it to the store.

Everything here runs Spark jobs; nothing is collected to the driver but counts and
per-column statistics, so data larger than the driver's memory works.
"""

import hashlib
import json
import logging
import math
import posixpath
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from hvd_spark._internal.specs import ColumnInfo, TensorSpec, check_feature_lengths, check_label_lengths
from hvd_spark._internal.store import Store

logger = logging.getLogger("hvd_spark")

VAL_COL = "__hvd_spark_is_val"
META_NAME = "_hvd_spark_meta.json"
FORMAT_VERSION = 1
TARGET_FILE_BYTES = 32 * 1024 * 1024


def column_info(df, name: str, role: str) -> ColumnInfo:
    """Classifies a column as scalar / array / vector, or raises a TypeError naming it."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import types as T

    if name not in df.columns:
        raise ValueError(f"{role} column '{name}' is not in the DataFrame. Available columns: {df.columns}.")
    dtype = df.schema[name].dataType
    numeric = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.DecimalType,
               T.BooleanType)
    integer = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)
    if isinstance(dtype, numeric):
        return ColumnInfo(name, "scalar", dtype.simpleString(), isinstance(dtype, integer))
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, numeric):
        return ColumnInfo(name, "array", dtype.elementType.simpleString(), isinstance(dtype.elementType, integer))
    if isinstance(dtype, (VectorUDT, OldVectorUDT)):
        return ColumnInfo(name, "vector", "double", False)
    raise TypeError(f"{role} column '{name}' has type {dtype.simpleString()}. Expected a numeric column, an array "
                    "of numbers, or a Vector (pyspark.ml.linalg).")


def _as_stored(df_col, info: ColumnInfo):
    """The column as it is written to Parquet: vectors become float arrays on the JVM side."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if info.kind == "vector":
        return vector_to_array(df_col, "float32").alias(info.name)
    if info.kind == "array":
        et = "int" if info.is_integer else "float"
        return df_col.cast(f"array<{et}>").alias(info.name)
    if info.element_type == "boolean":
        return df_col.cast("int").alias(info.name)
    if info.element_type.startswith("decimal"):
        return df_col.cast("double").alias(info.name)
    return df_col.alias(info.name)


def prepare(df, features: Sequence[ColumnInfo], labels: Sequence[ColumnInfo], weight: Optional[ColumnInfo],
            validation, seed: int):
    """The projected DataFrame that is checked and written (needed columns only, plus the split flag)."""
    from pyspark.sql import functions as F

    cols = [_as_stored(F.col(c.name), c) for c in list(features) + list(labels)]
    if weight is not None:
        cols.append(F.col(weight.name).cast("float").alias(weight.name))
    if isinstance(validation, str):
        v = F.col(validation)
        if dict(df.dtypes)[validation] == "boolean":
            cols.append(v.alias(VAL_COL))
        else:  # 1 / 0; anything else becomes null and is reported by check_stats
            cols.append(F.when(v == 1, F.lit(True)).when(v == 0, F.lit(False)).alias(VAL_COL))
    elif validation:
        cols.append((F.rand(seed) < float(validation)).alias(VAL_COL))
    else:
        cols.append(F.lit(False).alias(VAL_COL))
    # The same names can appear as feature and label; keep the first of each.
    seen, unique = set(), []
    for c, info in zip(cols, [*features, *labels, *([weight] if weight else []), None]):
        key = info.name if info is not None else VAL_COL
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return df.select(*unique)


def column_stats(prepared, infos: Sequence[ColumnInfo], validation) -> Dict:
    """One Spark job: row counts, nulls / NaNs per column, array lengths, validation flag range."""
    from pyspark.sql import functions as F

    aggs = [F.count(F.lit(1)).alias("rows"), F.sum(F.col(VAL_COL).cast("int")).alias("val_rows"),
            F.sum(F.col(VAL_COL).isNull().cast("int")).alias("val_nulls")]
    for i, info in enumerate({i.name: i for i in infos}.values()):
        c = F.col(info.name)
        if info.kind == "scalar":
            bad = c.isNull() | (F.isnan(c.cast("double")) if not info.is_integer else F.lit(False))
            aggs += [F.sum(bad.cast("int")).alias(f"bad_{i}"), F.lit(None).alias(f"min_{i}"),
                     F.lit(None).alias(f"max_{i}")]
        else:
            bad = c.isNull() | F.exists(c, lambda x: x.isNull() | F.isnan(x.cast("double")))
            aggs += [F.sum(bad.cast("int")).alias(f"bad_{i}"), F.min(F.size(c)).alias(f"min_{i}"),
                     F.max(F.size(c)).alias(f"max_{i}")]
    row = prepared.agg(*aggs).collect()[0].asDict()
    out = {"rows": row["rows"] or 0, "val_rows": row["val_rows"] or 0, "val_nulls": row["val_nulls"] or 0,
           "columns": {}}
    for i, info in enumerate({i.name: i for i in infos}.values()):
        out["columns"][info.name] = {"bad": row[f"bad_{i}"] or 0, "min_len": row[f"min_{i}"],
                                     "max_len": row[f"max_{i}"]}
    return out


def check_stats(stats: Dict, features: Sequence[ColumnInfo], labels: Sequence[ColumnInfo],
                weight: Optional[ColumnInfo], inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                validation, num_proc: int) -> None:
    """Raises ValueError for the first problem in the statistics (before anything is written)."""
    rows = stats["rows"]
    if rows == 0:
        raise ValueError("The DataFrame passed to fit() is empty: 0 rows. Expected at least one row per process "
                         f"(num_proc={num_proc}).")
    for role, infos in (("feature", features), ("label", labels), ("sample weight", [weight] if weight else [])):
        for info in infos:
            bad = stats["columns"][info.name]["bad"]
            if bad:
                raise ValueError(f"{role.capitalize()} column '{info.name}' has {bad} of {rows} rows with null or "
                                 "NaN values. Remove or fill them before fit (e.g. df.dropna() / df.fillna()).")
    for info, spec in zip(features, inputs):
        s = stats["columns"][info.name]
        check_feature_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind)
    for info, spec in zip(labels, outputs):
        s = stats["columns"][info.name]
        check_label_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind)
    if isinstance(validation, str) and stats["val_nulls"]:
        raise ValueError(f"validation column '{validation}' has {stats['val_nulls']} rows that are null or not 0/1. "
                         "Expected true/false or 1/0 in every row.")
    val_rows, train_rows = stats["val_rows"], rows - stats["val_rows"]
    if validation and val_rows == 0:
        raise ValueError(f"The validation split is empty (validation={validation!r} selected 0 of {rows} rows). "
                         "Raise the fraction, mark some rows in the validation column, or set validation=None.")
    if train_rows == 0:
        raise ValueError(f"The training split is empty: all {rows} rows went to validation ({validation!r}).")


def dataset_key(df, infos: Sequence[ColumnInfo], validation, seed: int) -> str:
    """Identifies a materialization: the DataFrame's query plan, the columns and the split."""
    spec = {"plan": df.semanticHash(), "columns": [i.to_dict() for i in infos], "validation": validation,
            "seed": seed if validation and not isinstance(validation, str) else None, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def _num_files(rows: int, row_bytes: int, num_proc: int) -> int:
    by_size = math.ceil(rows * max(row_bytes, 1) / TARGET_FILE_BYTES)
    n = max(num_proc, by_size)
    return min(max(1, rows), math.ceil(n / num_proc) * num_proc)


def _parquet_files(store: Store, path: str) -> List[Tuple[str, int]]:
    import pyarrow.parquet as pq

    out = []
    for name in store.listdir(path):
        if name.endswith(".parquet") and not name.startswith(("_", ".")):
            full = posixpath.join(path, name)
            with store.fs.open(full, "rb") as f:
                out.append((store.url(full), pq.ParquetFile(f).metadata.num_rows))
    return out


def materialize(prepared, store: Store, key: str, stats: Dict, row_bytes: int, num_proc: int) -> Dict:
    """Writes train / validation Parquet under ``data/<key>`` (or reuses it) and returns its metadata.

    Writes go to a temporary folder that is renamed into place once complete, so an interrupted
    write leaves nothing that a later fit could mistake for data.
    """
    final = store.data_path(key)
    meta_path = posixpath.join(final, META_NAME)
    if store.exists(meta_path):
        meta = store.read_json(meta_path)
        if len(meta["train_files"]) >= num_proc or meta["train_rows"] < num_proc:
            logger.info("reusing materialized data %s (%d train / %d val rows)", key,
                        meta["train_rows"], meta["val_rows"])
            return meta
        logger.info("materialized data %s has too few files for %d processes; writing it again",
                    key, num_proc)
    from pyspark.sql import functions as F

    t0 = time.time()
    tmp = store.path("data", f".tmp-{key}-{uuid.uuid4().hex[:8]}")
    train_rows, val_rows = stats["rows"] - stats["val_rows"], stats["val_rows"]
    try:
        for split, rows, cond in (("train", train_rows, ~F.col(VAL_COL)), ("val", val_rows, F.col(VAL_COL))):
            if rows == 0:
                continue
            n = _num_files(rows, row_bytes, num_proc)
            (prepared.filter(cond).drop(VAL_COL).repartition(n).write.mode("overwrite")
             .option("parquet.block.size", 256 * 1024 * 1024).option("compression", "snappy")
             .parquet(store.url(posixpath.join(tmp, split))))
        meta = {"key": key, "train_rows": train_rows, "val_rows": val_rows, "format": FORMAT_VERSION,
                "train_files": [], "val_files": [], "created": time.time()}
        if store.exists(final):
            store.rm(final)  # an incomplete earlier attempt (no metadata file)
        store.rename(tmp, final)
        for split in ("train", "val"):
            files = _parquet_files(store, posixpath.join(final, split)) if (train_rows if split == "train"
                                                                          else val_rows) else []
            meta[f"{split}_files"] = [[p, r] for p, r in files]
        store.write_json(meta_path, meta)
    except BaseException:
        store.rm(tmp)
        if not store.exists(meta_path):
            store.rm(final)
        raise
    logger.info("materialized %d train / %d val rows to %s in %.1fs", train_rows, val_rows,
                store.url(final), time.time() - t0)
    return meta
