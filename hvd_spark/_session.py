"""``hvd_spark.local_session``: a SparkSession for one machine, set up for barrier jobs."""

import os
import sys


def local_session(
    master: str = "local[*]",
    *,
    app_name: str = "hvd_spark",
    conf: dict[str, str] | None = None,
    prewarm: bool | int = True,
):
    """Returns a SparkSession on this machine (or the active one, if any).

    It binds the driver to the loopback address (``SPARK_LOCAL_IP`` defaults to 127.0.0.1),
    makes Python workers use this interpreter (``PYSPARK_PYTHON``, unless it is set or ``conf`` has
    ``spark.pyspark.python``), turns off the UI and enables
    Arrow for pandas conversions. Use it for examples, tests and single-machine jobs; on a cluster
    build your session as usual.

    Args:
        master: Spark master URL, e.g. ``local[2]`` or ``local-cluster[2,1,1024]``.
        app_name: the application name.
        conf: extra Spark conf entries.
        prewarm: a new session's executors start the warm server that a default ``fit``'s ranks
            fork from, in the background, as that ``fit`` would: TensorFlow's import (a few seconds)
            overlaps with what the caller does before ``fit``. A number: the ``num_proc`` of the fits
            to come, whose ranks fork from another server when it changes their threads (on
            ``local[2]``, ``num_proc=2`` gives each rank 1 thread, the default one rank 2). False: none.
            ``HVD_SPARK_WARM=0`` turns warm servers off, this one too.
    """
    if isinstance(prewarm, bool):
        num_proc = None
    elif isinstance(prewarm, int) and prewarm >= 1:
        num_proc = prewarm
    else:
        raise ValueError(
            "prewarm must be True, False or the num_proc of the fits to come (a positive integer). "
            f"Received: prewarm={prewarm!r}."
        )
    from hvd_spark._internal.common.requirements import require

    require("local_session", spark=True)
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers run this interpreter (and so see the same packages) unless told otherwise: by
    # PYSPARK_PYTHON, or by spark.pyspark.python in conf (pyspark's driver reads only the variable).
    os.environ.setdefault("PYSPARK_PYTHON", (conf or {}).get("spark.pyspark.python") or sys.executable)
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
        .config("spark.driver.bindAddress", os.environ["SPARK_LOCAL_IP"])
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    existing = SparkSession.getActiveSession()
    spark = builder.getOrCreate()
    if prewarm and existing is None:
        _prewarm(spark, num_proc)
    return spark


def _prewarm(spark, num_proc: int | None) -> None:
    """Starts, in the background, the warm server a default fit's ranks would fork from. Best effort."""
    import logging

    from hvd_spark._internal.driver.options import resolve_launch_options
    from hvd_spark._internal.driver.prewarm import prewarm

    try:
        prewarm(spark, resolve_launch_options(spark, num_proc=num_proc), background=True)
    except Exception as e:  # noqa: BLE001 - the first fit starts its warm server itself
        logging.getLogger(__name__).debug("no warm server started with the session: %s", e)
