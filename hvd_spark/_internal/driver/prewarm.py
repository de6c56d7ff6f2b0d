"""The short job a fit starts with its checks: each of its tasks checks that the executor's Python can
run hvd_spark (it imports this hvd_spark version) and, for warm ranks, starts the host's warm server,
so that TensorFlow is imported while the driver does other work. The fit waits for the answer before
it writes any data: a Python without hvd_spark is then a one-line ``ExecutorPythonError``, not a
failed barrier stage after the data was written."""

import importlib
import logging
import threading
import time

from hvd_spark._internal.common.sessions import is_connect
from hvd_spark._internal.driver.options import LaunchOptions
from hvd_spark.errors import ExecutorPythonError, HvdSparkError, JobCancelledError

logger = logging.getLogger(__name__)


class Prewarm:
    """The job's answer, once it came: :meth:`wait` for it."""

    def __init__(self) -> None:
        self.error: HvdSparkError | None = None  # ExecutorPythonError, or JobCancelledError
        self.seconds = 0.0  # the job's duration
        self._done = threading.Event()

    def wait(self, timeout: float) -> float:
        """Waits up to ``timeout`` seconds for the answer. Returns the seconds waited.

        Raises:
            ExecutorPythonError: the executors' Python cannot run hvd_spark.
            JobCancelledError: the check was cancelled (the user's job group or tag).
        """
        began = time.monotonic()
        if not self._done.wait(timeout):
            logger.warning(
                "the executors' check (a Spark job of the fit) did not answer within %.0f s (start_timeout); "
                "going on without it",
                timeout,
            )
        if self.error is not None:
            raise self.error
        return time.monotonic() - began


def prewarm(spark, options: LaunchOptions, background: bool = False) -> Prewarm:
    """Runs the job (``num_proc`` tasks): each checks the executor's Python and, when the job's ranks
    are warm (``options.forks_warm``), starts the host's warm server. With ``background``, the job
    runs in a thread of its own. Only a Python that cannot run hvd_spark is an error (``wait``);
    any other failure only means that the ranks start cold."""
    answer = Prewarm()
    if background:
        _thread_of(spark, lambda: _run(spark, options, answer)).start()
    else:
        _run(spark, options, answer)
    return answer


def _thread_of(spark, target) -> threading.Thread:
    """A thread whose Spark jobs carry the caller's job group, tags and local properties (pyspark's
    ``InheritableThread``): cancelling the user's group or tag stops the check too. On Spark Connect,
    the caller's tags are added in the thread (they are per thread there)."""
    if is_connect(spark):
        tags = sorted(spark.getTags()) if hasattr(spark, "getTags") else []

        def tagged():
            for t in tags:
                spark.addTag(t)
            target()

        thread = threading.Thread(target=tagged, name="hvd_spark-prewarm", daemon=True)
    else:
        from pyspark import InheritableThread

        thread = InheritableThread(target)
        thread.name = "hvd_spark-prewarm"
        thread.daemon = True
    return thread


def _run(spark, options: LaunchOptions, answer: Prewarm) -> None:
    from hvd_spark._internal.common.logs import rank_env_defaults
    from hvd_spark._internal.common.requirements import executor_python_problem, executors_check

    extra, threads, app, n = rank_env_defaults(options.env), int(options.num_threads), options.app, options.num_proc
    warm = options.forks_warm
    version = importlib.import_module("hvd_spark").__version__

    def start(_):  # on an executor: nothing of hvd_spark's until the imports below are checked
        import json
        import sys

        try:
            executor_version = importlib.import_module("hvd_spark").__version__
            from hvd_spark._internal.task.barrier import prewarm as task_prewarm
        except Exception as e:  # noqa: BLE001 - the driver says how to fix it
            yield json.dumps({"python": sys.executable, "error": f"{type(e).__name__}: {e}"})
            return
        fp = ""
        if warm:
            try:
                fp = task_prewarm(extra, threads, app)
            except Exception as e:  # noqa: BLE001 - reported on the driver, the launch goes on cold
                fp = f"failed: {e}"
        yield json.dumps({"python": sys.executable, "version": executor_version, "fp": fp})

    t0 = time.monotonic()
    try:
        try:
            rows = _collect(spark, start, n)
        except Exception as e:  # noqa: BLE001 - a Python that cannot run hvd_spark is the fit's error
            from hvd_spark._internal.driver.classic import _was_cancelled

            problem = executor_python_problem(str(e))
            if problem is not None:
                answer.error = ExecutorPythonError("", problem, version)
            elif _was_cancelled(e):  # the user's job group or tag, which the check runs under
                answer.error = JobCancelledError(
                    "the fit was cancelled during its first step (its executors' check, a Spark job of the user's "
                    f"job group and tags); nothing was written. Spark said: {str(e).strip().splitlines()[0]}"
                )
            else:
                logger.info("could not start warm servers ahead of the job (%s); ranks start cold", e)
            return
        answer.error = executors_check(rows, version)
        failed = [r for r in rows if '"fp": "failed' in r]
        if failed:
            logger.info("could not start warm servers ahead of the job (%s); ranks start cold", failed[0])
        logger.debug("executors checked (warm servers asked for: %s) in %.2f s", warm, time.monotonic() - t0)
    finally:
        answer.seconds = time.monotonic() - t0
        answer._done.set()


def _collect(spark, start, n: int) -> list[str]:
    """``start``'s rows from ``n`` tasks, on a classic session or Spark Connect."""
    if is_connect(spark):
        import pandas as pd

        def start_batches(batches):
            for _ in batches:
                pass
            yield pd.DataFrame({"answer": list(start(None))})

        return [r.answer for r in spark.range(0, n, 1, n).mapInPandas(start_batches, "answer string").collect()]
    return spark.sparkContext.parallelize(range(n), n).mapPartitions(start).collect()
