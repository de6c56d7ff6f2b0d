"""``hvd_spark.run``: run any Horovod function on Spark barrier tasks."""

from collections.abc import Callable
from typing import Any

from hvd_spark._internal.driver.launcher import launch


def run(
    fn: Callable,
    args=(),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    spark=None,
    backend: str | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    verbose: int = 1,
    store=None,
    warm: bool | None = None,
    stall_timeout: float | None = None,
    use_gpu: bool | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Horovod ranks as one Spark barrier stage.

    Each barrier task starts one rank in a child process with the Horovod environment set,
    so ``fn`` calls ``hvd.init()`` and finds its rank, size and peers. Rank 0's task serves
    Gloo's rendezvous. The ranks' output reaches the driver's ``hvd_spark.rank`` logger,
    prefixed with the rank.

    Args:
        fn: the function each rank runs; it and its arguments must pickle with cloudpickle.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: number of ranks; defaults to the application's task slots. Must not exceed them.
        spark: the SparkSession to use; defaults to the active one.
        backend: Horovod's controller, ``"gloo"`` (the default on CPU) or ``"mpi"`` (``mpirun``
            started by rank 0's task; all tasks on one host; needs Horovod built with MPI). The
            same name as the estimator's ``backend`` param.
        use_gloo: ``backend="gloo"``, as ``horovod.spark.run`` spells it.
        use_mpi: ``backend="mpi"``, as ``horovod.spark.run`` spells it.
        env: extra environment variables for every rank; they win over hvd_spark's defaults
            (e.g. ``TF_NUM_INTEROP_THREADS``), not over the rank's identity.
        num_threads: compute threads per rank (TF intra/inter-op, OpenMP); defaults to
            ``spark.task.cpus``.
        start_timeout: seconds for all barrier tasks to start (default 600; also
            ``HVD_SPARK_START_TIMEOUT`` or ``spark.hvd_spark.startTimeout``).
        timeout: seconds for the whole job (default: no limit). When it runs out, every rank
            prints its Python stack, the job is stopped, and the error names the ranks that had
            not finished and where each one was (e.g. waiting in an allreduce, or in user code).
        verbose: 1 shows the ranks' output and progress on stderr when logging is not configured.
        store: on a Spark Connect session, a store (a path or URL that this client and the
            cluster can both reach, or a :class:`hvd_spark.Store`) where the ranks' output is written
            while the job runs, so that it shows as it comes; without it, it shows when the job ends.
            Ignored on a classic session, whose driver receives the output directly.
        warm: start each rank from the host's warm server, a process that has already imported
            TensorFlow, Keras and Horovod and forks a fresh rank for every job (Gloo only; the first
            job of an application starts the server). Default: on, unless ``HVD_SPARK_WARM=0``.
            See ``docs/launcher.md``.
        stall_timeout: seconds a rank may go without calling :func:`hvd_spark.mark_progress`
            before the job is stopped as stalled (a hung rank, a collective that one rank never
            joins): every rank prints its stack and :class:`hvd_spark.RankStalledError` names the
            stalled ranks, their hosts and where each was. Default: no watchdog (a function that
            does not call ``mark_progress`` would look stalled), unless ``HVD_SPARK_STALL_TIMEOUT``.
        use_gpu: give each rank exactly the GPUs Spark assigned to its task (``CUDA_VISIBLE_DEVICES``,
            TensorFlow's memory growth on, NCCL for Horovod's GPU collectives when built with it).
            Default: True when ``spark.task.resource.gpu.amount`` is set. See ``docs/gpu.md``.

    Returns:
        The return values of ``fn``, ordered by rank.

    Raises:
        ValueError: ``num_proc`` < 1 or larger than the task slots; MPI asked for but not built.
        RankFailedError: a rank raised or died; the other ranks were stopped.
        JobTimeoutError: tasks did not start, or the job did not finish, in time.
        RankStalledError: (a JobTimeoutError) a rank made no progress for ``stall_timeout`` seconds.
        LaunchError: the Spark stage failed for another reason.

    Example:
        >>> def allreduce():
        ...     import horovod.tensorflow as hvd
        ...     import tensorflow as tf
        ...     hvd.init()
        ...     return hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy().tolist()
        >>> hvd_spark.run(allreduce, num_proc=2)   # doctest: +SKIP
        [[3.0], [3.0]]
    """
    from hvd_spark._internal.common.logs import ensure_visible
    from hvd_spark._internal.common.requirements import require

    require("hvd_spark.run", spark=True)
    ensure_visible(verbose)
    channel = None
    if store is not None:
        from hvd_spark._internal.data.store import Store

        store = Store.create(store)
        channel = (store, store._path("jobs"))
    return launch(
        fn,
        args,
        kwargs,
        num_proc=num_proc,
        spark=spark,
        backend=backend,
        use_gloo=use_gloo,
        use_mpi=use_mpi,
        env=env,
        num_threads=num_threads,
        start_timeout=start_timeout,
        timeout=timeout,
        description="hvd_spark.run",
        channel=channel,
        warm=warm,
        stall_timeout=stall_timeout,
        use_gpu=use_gpu,
    )
