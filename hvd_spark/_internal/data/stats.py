"""Per-column statistics of the data a fit trains on (counts, nulls, ranges, lengths), computed in
the same pass that writes it, and the checks of those statistics against the model: label ranges,
class indices, row lengths. Driver side."""

import logging
from collections.abc import Sequence
from typing import Any

from hvd_spark._internal.common.specs import (
    ColumnInfo,
    TensorSpec,
    check_feature_lengths,
    check_label_lengths,
    check_value_range,
)
from hvd_spark._internal.data.store import VAL_COL

logger = logging.getLogger(__name__)


def stats_aggs(infos: Sequence[ColumnInfo]) -> list:
    """The aggregate expressions of the data's statistics: row counts, nulls / NaNs / infinities per
    column (elements of arrays included), array lengths, value ranges (of the elements, for arrays:
    bigint for integer columns, double otherwise) and the validation flag. Computed while the data is
    written (``DataFrame.observe``), so the input is evaluated once."""
    from pyspark.sql import functions as F

    aggs = [
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.col(VAL_COL).cast("int")).alias("val_rows"),
        F.sum(F.col(VAL_COL).isNull().cast("int")).alias("val_nulls"),
    ]
    for i, info in enumerate(_unique(infos)):
        c = F.col(info.stored)
        number = "bigint" if info.is_integer else "double"  # the range: exact for 64-bit integers
        if info.element_type in ("string", "binary"):  # a string or bytes feature: only nulls matter
            aggs += [
                F.sum(c.isNull().cast("int")).alias(f"bad_{i}"),
                F.lit(None).cast("int").alias(f"min_{i}"),
                F.lit(None).cast("int").alias(f"max_{i}"),
                F.lit(None).cast("double").alias(f"lo_{i}"),
                F.lit(None).cast("double").alias(f"hi_{i}"),
                F.lit(None).cast("int").alias(f"frac_{i}"),
            ]
        elif info.kind == "scalar":
            bad = c.isNull() | (F.lit(False) if info.is_integer else _not_finite(c))
            aggs += [
                F.sum(bad.cast("int")).alias(f"bad_{i}"),
                F.lit(None).cast("int").alias(f"min_{i}"),
                F.lit(None).cast("int").alias(f"max_{i}"),
                F.min(c.cast(number)).alias(f"lo_{i}"),
                F.max(c.cast(number)).alias(f"hi_{i}"),
                # a remainder, not floor(): Spark's floor gives a bigint, an ANSI error for infinities
                F.sum(((c.cast("double") % F.lit(1.0)) != F.lit(0.0)).cast("int")).alias(f"frac_{i}"),
            ]
        else:
            bad = c.isNull() | F.exists(c, lambda x: x.isNull() | _not_finite(x))
            aggs += [
                F.sum(bad.cast("int")).alias(f"bad_{i}"),
                F.min(F.size(c)).alias(f"min_{i}"),
                F.max(F.size(c)).alias(f"max_{i}"),
                F.min(F.array_min(c).cast(number)).alias(f"lo_{i}"),  # the elements' range
                F.max(F.array_max(c).cast(number)).alias(f"hi_{i}"),
                F.lit(None).cast("int").alias(f"frac_{i}"),
            ]
    return aggs


def _not_finite(c):
    """Spark expression: a NaN or an infinity (for any number column; false for a null)."""
    from pyspark.sql import functions as F

    d = c.cast("double")
    return F.isnan(d) | (F.abs(d) == F.lit(float("inf")))


def _unique(infos: Sequence[ColumnInfo]) -> list[ColumnInfo]:
    return list({i.name: i for i in infos}.values())


def stats_from(row: dict, infos: Sequence[ColumnInfo]) -> dict:
    """The statistics (plain JSON) from the values of :func:`stats_aggs`."""
    out: dict[str, Any] = {
        "rows": row["rows"] or 0,
        "val_rows": row["val_rows"] or 0,
        "val_nulls": row["val_nulls"] or 0,
        "columns": {},
    }
    for i, info in enumerate(_unique(infos)):
        out["columns"][info.name] = {
            "bad": row[f"bad_{i}"] or 0,
            "min_len": row[f"min_{i}"],
            "max_len": row[f"max_{i}"],
            "min": row[f"lo_{i}"],
            "max": row[f"hi_{i}"],
            "fractional": row[f"frac_{i}"] or 0,
        }
    return out


def column_stats(prepared, infos: Sequence[ColumnInfo], validation=None) -> dict:
    """The statistics in a Spark job of their own (fit computes them while writing instead)."""
    return stats_from(prepared.agg(*stats_aggs(infos)).collect()[0].asDict(), infos)


def check_stats(
    stats: dict,
    features: Sequence[ColumnInfo],
    labels: Sequence[ColumnInfo],
    weight: ColumnInfo | None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    validation,
    num_proc: int,
    class_indices: Sequence[bool | None] | None = None,
) -> None:
    """Raises ValueError for the first problem in the statistics (before any rank starts).
    ``class_indices[i]``: output ``i`` is trained with a sparse cross-entropy (its labels are class indices);
    None: its labels go to the user's code as they are (any length)."""
    rows = stats["rows"]
    if rows == 0:
        raise ValueError(
            "The DataFrame passed to fit() is empty: 0 rows. Expected at least one row per process "
            f"(num_proc={num_proc})."
        )
    for role, infos in (("feature", features), ("label", labels), ("sample weight", [weight] if weight else [])):
        for info in infos:
            s = stats["columns"][info.name]
            if s["bad"]:
                raise ValueError(
                    f"{role.capitalize()} column '{info.name}' has {s['bad']} of {rows} rows with null, NaN or "
                    "infinite values. Remove or fill them before fit (e.g. df.dropna() / df.fillna(), "
                    "df.replace(float('inf'), ...))."
                )
            if s.get("overflow"):  # only a table read in place: the DataFrame's own casts, done by the ranks
                raise ValueError(
                    f"{role.capitalize()} column '{info.name}' has {s['overflow']} of {rows} rows with values beyond "
                    f"the range of {s['cast']}, the type the DataFrame casts it to (e.g. {_num(s['overflow_value'])}); "
                    "Spark's ANSI cast refuses them. Cast it to a wider type (bigint, double), or remove those rows."
                )
    for info, spec in zip(features, inputs):
        s = stats["columns"][info.name]
        check_feature_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind)
        if info.element_type not in ("string", "binary"):
            check_value_range("feature", info.name, s["min"], s["max"], spec.dtype or "float32", spec)
    for i, (info, spec) in enumerate(zip(labels, outputs)):
        s = stats["columns"][info.name]
        given = class_indices[i] if class_indices is not None and i < len(class_indices) else False
        sparse = bool(given)
        if given is not None:  # None: labels the user's code reads as they are (a LightningModule's)
            check_label_lengths(info.name, spec, s["min_len"], s["max_len"], info.kind, sparse)
        if sparse:
            check_class_indices(info, spec, s)
        # the reader gives the model integer labels as int32, others as float32
        check_value_range("label", info.name, s["min"], s["max"], "int32" if info.is_integer else "float32")
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


def check_class_indices(info: ColumnInfo, spec: TensorSpec, s: dict) -> None:
    """A label of an output trained with a sparse cross-entropy holds class indices (one, or one per step or
    pixel of the output): every value must be a whole number in ``[0, units)``, ``units`` the size of the
    output's class axis, or the loss's ``ignore_index`` (torch's masked positions: only the extremes are
    known here). Raises ValueError naming the column and a value."""
    units = spec.shape[spec.class_axis] if spec.elements is not None and spec.shape else None
    if units is None or units < 2 or s.get("min") is None:
        return
    low, high = s["min"], s["max"]
    ignored = spec.ignore_index
    if (low < 0 and low != ignored) or (high > units - 1 and high != ignored):
        bad = low if low < 0 and low != ignored else high
        raise ValueError(
            f"label column '{info.name}' holds class indices for output '{spec.name}', which has {units} units: "
            f"every label must be in [0, {units - 1}]. Received labels from {_num(low)} to {_num(high)} "
            f"(e.g. {_num(bad)}). Re-index the labels (e.g. pyspark.ml.feature.StringIndexer), or give the "
            "output one unit per class."
        )
    if s.get("fractional"):
        raise ValueError(
            f"label column '{info.name}' holds class indices for output '{spec.name}' ({units} units), but "
            f"{s['fractional']} rows are not whole numbers. Expected integers in [0, {units - 1}]."
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else repr(x)
