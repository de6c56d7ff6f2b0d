"""hvd_spark: train Keras 3 models on Spark DataFrames with Horovod ring-allreduce.

Public API:
    HorovodEstimator: fit a Keras 3 model on a DataFrame; returns a TFTransformer.
    TFTransformer: adds the model's predictions to a DataFrame (an iterator Arrow UDF on pyspark >= 4.1,
        else an iterator pandas UDF; after a fit, on CPU, the model sits in a child of the host's warm
        server, which the UDF's workers hand their batches to).
    KerasEstimator, KerasModel: horovod.spark.keras's names for HorovodEstimator and TFTransformer
        (the same classes), so that ``import hvd_spark as hvd`` ports ``import horovod.spark.keras as hvd``.
    SparkBackend: horovod.spark's ``SparkBackend(num_proc, env, stdout=..., ...)``: a fit's ranks as
        Spark barrier tasks, as with the default backend (docs/estimator.md, "Porting from horovod.spark").
    Store, Checkpoint: shared storage for data, checkpoints and models; one complete checkpoint.
    run: run any Horovod function on Spark barrier tasks.
    local_session: a SparkSession for one machine, set up for barrier jobs.
    FitSummary, RankSummary, Recovery: what ``TFTransformer.getFitSummary()`` reports about the fit.
    HvdSparkError, RankFailedError, JobTimeoutError, JobDeadlineError, RankStalledError, NotEnoughSlotsError,
        LaunchError, ExecutorPythonError, RunInUseError, JobCancelledError, DataChangedError,
        StoreUnavailableError, DataPreparationError: run-time errors.
    mark_progress: for functions run with ``run``: tells the stall watchdog this rank progresses.
    commit_state, committed_state: for functions run with ``run(..., max_restarts=...)``: rank 0's
        latest state, from which a restarted (or resized) attempt continues.

    hvd_spark.keras (imported on its own): Keras 3 gradient averaging and callbacks for functions
    run with ``run``; ``BestModelCheckpoint`` (horovod's) for the estimator's ``checkpoint_callback``.
"""

from hvd_spark._internal.common.commits import commit_state, committed_state
from hvd_spark._internal.common.contracts import FitSummary, RankSummary, Recovery
from hvd_spark._internal.common.events import mark_progress
from hvd_spark._internal.data.store import Checkpoint, Store
from hvd_spark._internal.ml.backend import SparkBackend
from hvd_spark._run import run
from hvd_spark._session import local_session
from hvd_spark.errors import (
    DataChangedError,
    DataPreparationError,
    ExecutorPythonError,
    HvdSparkError,
    JobCancelledError,
    JobDeadlineError,
    JobTimeoutError,
    LaunchError,
    NotEnoughSlotsError,
    RankFailedError,
    RankStalledError,
    RunInUseError,
    StoreUnavailableError,
)

# name -> "module" (the name itself there) or "module:name there" (horovod.spark.keras's names)
_LAZY = {
    "HorovodEstimator": "hvd_spark._internal.ml.estimator",
    "TFTransformer": "hvd_spark._internal.ml.transformer",
    "KerasEstimator": "hvd_spark._internal.ml.estimator:HorovodEstimator",
    "KerasModel": "hvd_spark._internal.ml.transformer:TFTransformer",
}


def __getattr__(name):
    # The estimator and transformer import pyspark.ml and Keras; rank processes must not pay for that.
    if name in _LAZY:
        import importlib

        from hvd_spark._internal.common.requirements import require

        module, _, attr = _LAZY[name].partition(":")
        require(name, spark=True, tensorflow=True)
        return getattr(importlib.import_module(module), attr or name)
    raise AttributeError(f"module 'hvd_spark' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "HorovodEstimator",
    "TFTransformer",
    "KerasEstimator",
    "KerasModel",
    "SparkBackend",
    "Store",
    "Checkpoint",
    "run",
    "local_session",
    "FitSummary",
    "RankSummary",
    "Recovery",
    "HvdSparkError",
    "DataChangedError",
    "DataPreparationError",
    "RankFailedError",
    "JobTimeoutError",
    "JobDeadlineError",
    "RankStalledError",
    "NotEnoughSlotsError",
    "mark_progress",
    "commit_state",
    "committed_state",
    "LaunchError",
    "ExecutorPythonError",
    "RunInUseError",
    "JobCancelledError",
    "StoreUnavailableError",
]
