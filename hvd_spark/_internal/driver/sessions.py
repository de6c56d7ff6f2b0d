"""Classic SparkSession or Spark Connect: what hvd_spark reads from a session, without touching a
SparkContext where there is none (a Connect client has no JVM and no RDDs)."""

import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (``SparkSession.builder.remote(...)``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def session_conf(spark) -> Any:
    """Something with ``get(key, default)`` holding the application's settings: the SparkConf of a
    classic session, the runtime conf of a Connect session (which answers for static keys too)."""
    if is_connect(spark):
        return spark.conf
    return spark.sparkContext.getConf()


def application_id(spark) -> str:
    """The application's id (what warm servers are keyed by): ``spark.app.id``, or for a Connect
    session that does not tell it, one per session."""
    return session_conf(spark).get("spark.app.id", None) or f"connect-{spark.session_id}"


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
