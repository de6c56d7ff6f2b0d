"""The session ``run`` and ``fit_on_parquet`` use: the one given, the active one, or one this driver
starts. What hvd_spark reads from a session (classic or Connect) is in ``common/sessions.py``."""

import logging
import os
import sys

logger = logging.getLogger(__name__)


def active_session(spark=None):
    """``spark``, else the active SparkSession, else a new one (``getOrCreate``) whose Python workers
    run this interpreter, which has hvd_spark: ``PYSPARK_PYTHON`` is set to ``sys.executable`` for it
    unless it is set already (Spark reads it when the SparkContext starts)."""
    if spark is not None:
        return spark
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
        logger.info("no active SparkSession: starting one whose Python workers run %s (PYSPARK_PYTHON)", sys.executable)
    return SparkSession.builder.getOrCreate()
