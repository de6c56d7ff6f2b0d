"""Spark expressions that the transformer's UDF needs around the model: the status of each
feature (value, null, null elements, NaN or infinity) and whether this pyspark has Arrow UDFs.
Driver side."""


def has_null_element(array_col):
    """Spark expression: whether an array column holds a null element (null for a null array)."""
    from pyspark.sql import functions as F

    return F.exists(array_col, lambda x: x.isNull())


def can_be_nonfinite(info) -> bool:
    """Whether a feature (a ``ColumnInfo``) can hold a NaN or an infinity: floating-point numbers."""
    return info.kind == "vector" or (info.kind in ("scalar", "array") and info.element_type in ("float", "double"))


def _not_finite(x):
    from pyspark.sql import functions as F

    return F.isnan(x) | (F.abs(x) == F.lit(float("inf")))


def has_nonfinite(info, expr):
    """Spark expression: whether a feature (``expr``, as ``feature_expr`` gives it) holds a NaN or an
    infinity (null for a null); None for a feature that cannot (see :func:`can_be_nonfinite`)."""
    from pyspark.sql import functions as F

    if not can_be_nonfinite(info):
        return None
    return _not_finite(expr) if info.kind == "scalar" else F.exists(expr, _not_finite)


def feature_status(info, expr):
    """Spark expression of a feature's status for :func:`predict_batches`: 0 a value, 1 null, 2 an
    array holding a null element, 3 a NaN or an infinity (in an array: any element)."""
    from pyspark.sql import functions as F

    status = F.when(expr.isNull(), F.lit(1))
    if info.kind == "array":
        status = status.when(has_null_element(expr), F.lit(2))
    nonfinite = has_nonfinite(info, expr)
    if nonfinite is not None:
        status = status.when(nonfinite, F.lit(3))
    return status.otherwise(F.lit(0)).cast("tinyint")


def arrow_udfs_available() -> bool:
    """Whether this pyspark has Arrow-native UDFs (``pyspark.sql.functions.arrow_udf``, Spark >= 4.1)."""
    try:
        from pyspark.sql.functions import arrow_udf  # noqa: F401

        return True
    except ImportError:
        return False
