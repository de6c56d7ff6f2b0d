"""Spark expressions that the transformer's UDF needs around the model: the status of each
feature (value, null, null elements) and whether this pyspark has Arrow UDFs. Driver side."""


def has_null_element(array_col):
    """Spark expression: whether an array column holds a null element (null for a null array)."""
    from pyspark.sql import functions as F

    return F.exists(array_col, lambda x: x.isNull())


def feature_status(info, expr):
    """Spark expression of a feature's status for :func:`predict_batches`: 0 a value (NaN included),
    1 null, 2 an array holding a null element."""
    from pyspark.sql import functions as F

    status = F.when(expr.isNull(), F.lit(1))
    if info.kind == "array":
        status = status.when(has_null_element(expr), F.lit(2))
    return status.otherwise(F.lit(0)).cast("tinyint")


def arrow_udfs_available() -> bool:
    """Whether this pyspark has Arrow-native UDFs (``pyspark.sql.functions.arrow_udf``, Spark >= 4.1)."""
    try:
        from pyspark.sql.functions import arrow_udf  # noqa: F401

        return True
    except ImportError:
        return False
