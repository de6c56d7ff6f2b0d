"""hvd_spark: train Keras 3 models on Spark DataFrames with Horovod ring-allreduce.

Public API:
    run: run any Horovod function on Spark barrier tasks.
    local_session: a SparkSession for one machine, set up for barrier jobs.
    HvdSparkError, RankFailedError, JobTimeoutError, LaunchError: run-time errors.
"""

from hvd_spark._run import run
from hvd_spark._session import local_session
from hvd_spark.errors import HvdSparkError, JobTimeoutError, LaunchError, RankFailedError

__version__ = "0.1.0"

__all__ = [
    "run",
    "local_session",
    "HvdSparkError",
    "RankFailedError",
    "JobTimeoutError",
    "LaunchError",
]
