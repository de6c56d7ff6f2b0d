"""Warm servers started ahead of a job: the executors import TensorFlow while the driver prepares."""

import logging
import threading
import time

from hvd_spark._internal.driver.options import LaunchOptions
from hvd_spark._internal.driver.sessions import is_connect

logger = logging.getLogger(__name__)


def prewarm(spark, options: LaunchOptions, background: bool = False) -> threading.Thread | None:
    """Has the executors start their warm servers now (a short Spark job of ``num_proc`` tasks),
    so that they import TensorFlow while the driver does other work (``fit`` checks and
    materializes its data meanwhile). Best effort: a failure only means the job starts its ranks
    cold. With ``background``, the job runs in a thread of its own (returned)."""
    if not options.forks_warm:
        return None
    if background:
        t = threading.Thread(target=prewarm, args=(spark, options), name="hvd_spark-prewarm", daemon=True)
        t.start()
        return t
    from hvd_spark._internal.common.logs import rank_env_defaults

    extra, threads, app, n = rank_env_defaults(options.env), int(options.num_threads), options.app, options.num_proc

    def start(_):
        from hvd_spark._internal.task.barrier import prewarm as task_prewarm

        try:
            yield task_prewarm(extra, threads, app)
        except Exception as e:  # noqa: BLE001 - reported on the driver, the launch goes on cold
            yield f"failed: {e}"

    t0 = time.monotonic()
    try:
        if is_connect(spark):
            import pandas as pd

            def start_batches(batches):
                for _ in batches:
                    pass
                yield pd.DataFrame({"fp": list(start(None))})

            rows = [r.fp for r in spark.range(0, n, 1, n).mapInPandas(start_batches, "fp string").collect()]
        else:
            rows = spark.sparkContext.parallelize(range(n), n).mapPartitions(start).collect()
    except Exception as e:  # noqa: BLE001
        logger.info("could not start warm servers ahead of the job (%s); ranks start cold", e)
        return None
    failed = [r for r in rows if r.startswith("failed")]
    logger.debug("warm servers %s asked for in %.2f s", sorted(set(rows)), time.monotonic() - t0)
    if failed:
        logger.info("could not start warm servers ahead of the job (%s); ranks start cold", failed[0])
    return None
