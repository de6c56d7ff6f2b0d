"""Classic SparkSession or Spark Connect: what hvd_spark reads from a session, without touching a
SparkContext where there is none (a Connect client has no JVM and no RDDs). Plain functions of a
session object: they load no pyspark (the driver starts a session: ``driver/sessions.py``)."""

from typing import Any


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
