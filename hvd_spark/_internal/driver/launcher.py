"""The driver side of a Horovod job on Spark barrier tasks.

:func:`launch` validates the request, starts the driver service, submits one barrier stage
of ``num_proc`` tasks in a background thread and watches it: tasks that do not start in
time, ranks that fail (the others are then aborted), and an optional overall timeout. It
knows nothing about Keras; the estimator builds on it.

On Spark Connect the client has no JVM and accepts no connection from the cluster: :func:`launch`
submits the stage through the session, the driver service and its supervisor run in the first
barrier task (:mod:`.coordinator`), and the client follows the job through the store
(``common/channel.py``) and decides its result from the stage's output rows with the same
``supervisor.conclude``.

The pieces: :mod:`.options` (the launch options, checked before any work starts), :mod:`.slots`
(the application's task slots and the pool of them this driver's jobs hold), :mod:`.prewarm` (warm
servers started ahead of a job), :mod:`.classic` and :mod:`.connect` (running and watching the
stage on each kind of session) and :mod:`.stage` (what those two share).
"""

import logging
from collections.abc import Callable
from typing import Any

import cloudpickle

from hvd_spark._internal.common.sessions import is_connect
from hvd_spark._internal.driver.classic import launch_classic
from hvd_spark._internal.driver.connect import launch_connect
from hvd_spark._internal.driver.options import LaunchOptions, resolve_launch_options
from hvd_spark._internal.driver.sessions import active_session
from hvd_spark._internal.driver.slots import SLOTS

logger = logging.getLogger(__name__)


def pickled_payload(fn: Callable, args=(), kwargs=None) -> bytes:
    """``(fn, args, kwargs)`` pickled for the ranks; a clear error names what does not pickle."""
    if not callable(fn):
        raise TypeError(f"fn must be callable. Received: {type(fn).__name__}.")
    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(f"fn and its arguments must be picklable with cloudpickle: {e}") from e


def launch(
    fn: Callable,
    args=(),
    kwargs=None,
    *,
    num_proc: int | None = None,
    spark=None,
    backend: str | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    on_event: Callable[[int, dict], None] | None = None,
    description: str = "hvd_spark job",
    options: LaunchOptions | None = None,
    channel=None,
    warm: bool | None = None,
    stall_timeout: float | None = None,
    use_gpu: bool | None = None,
    on_log: Callable[[int, str], None] | None = None,
    layout: str | None = None,
) -> list[Any]:
    """Runs ``fn`` on Horovod ranks; see :func:`hvd_spark.run` for the arguments.

    ``options``, resolved earlier with :func:`resolve_launch_options`, replaces the option
    arguments (the estimator resolves them before it writes any data). ``channel``, a
    ``(Store, folder)`` pair, is where a job launched through Spark Connect writes the ranks'
    output and progress while it runs; without it they reach the client when the job ends.
    ``on_log(rank, line)`` receives the ranks' output lines instead of the ``hvd_spark.rank`` logger.
    """
    payload = pickled_payload(fn, args, kwargs)
    spark = active_session(spark)
    if options is None:
        options = resolve_launch_options(
            spark,
            num_proc=num_proc,
            backend=backend,
            use_gloo=use_gloo,
            use_mpi=use_mpi,
            env=env,
            num_threads=num_threads,
            start_timeout=start_timeout,
            timeout=timeout,
            warm=warm,
            stall_timeout=stall_timeout,
            use_gpu=use_gpu,
            layout=layout,
            layout_default="slot",  # horovod.spark.run's: one process per task slot
        )
    with SLOTS.claim(options.app, options.num_proc * options.slots_each, options.slots, description):
        logger.info(
            "starting %d ranks (%s) on %s: %s", options.num_proc, options.backend, options.master, options.layout_why
        )
        if is_connect(spark):
            return launch_connect(
                spark, payload, options, on_event=on_event, description=description, channel=channel, on_log=on_log
            )
        return launch_classic(
            spark.sparkContext, payload, options, on_event=on_event, description=description, on_log=on_log
        )
