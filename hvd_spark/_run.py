"""``hvd_spark.run``: run any Horovod function on Spark barrier tasks."""

from collections.abc import Callable
from typing import Any

from hvd_spark._internal.driver.launcher import launch
from hvd_spark._internal.driver.signals import ends_on_sigterm


@ends_on_sigterm("hvd_spark.run")  # SIGTERM: the cancel's clean-up, then the process ends (driver/signals.py)
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
    max_restarts: int = 0,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    elastic_timeout: float | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` Horovod ranks as one Spark barrier stage.

    Each barrier task starts one rank in a child process with the Horovod environment set,
    so ``fn`` calls ``hvd.init()`` and finds its rank, size and peers. Rank 0's task serves
    Gloo's rendezvous. The ranks' output reaches the driver's ``hvd_spark.rank`` logger,
    prefixed with the rank.
    Each rank also has the variables ``torchrun`` sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so a function written for ``torch.distributed`` or pyspark's
    ``TorchDistributor`` calls ``dist.init_process_group("gloo")`` unchanged (docs/launcher.md,
    "torch.distributed functions").

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
        max_restarts: times a failed job (a rank raising or dying, a lost executor, a stall) is started
            again (default 0). Each new attempt calls ``fn`` anew on every rank; there,
            :func:`hvd_spark.committed_state` returns the state rank 0 last passed to
            :func:`hvd_spark.commit_state`, so ``fn`` continues from it. See docs/launcher.md,
            "Restarts and elastic jobs".
        min_num_proc: elastic: each attempt runs on the task slots there are, at least this many
            (``num_proc`` is then only the first attempt's size); after a lost executor the job goes on
            with fewer ranks instead of waiting for the lost slots. Needs ``max_restarts >= 1``.
        max_num_proc: elastic: at most this many ranks (default: every task slot).
        elastic_timeout: elastic: seconds with fewer than ``min_num_proc`` slots before
            :class:`hvd_spark.NotEnoughSlotsError` (default 600).

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
        channel = (store, store.files.path("jobs"))
    launch_kwargs = dict(
        spark=spark,
        backend=backend,
        use_gloo=use_gloo,
        use_mpi=use_mpi,
        num_threads=num_threads,
        start_timeout=start_timeout,
        timeout=timeout,
        description="hvd_spark.run",
        channel=channel,
        warm=warm,
        stall_timeout=stall_timeout,
        use_gpu=use_gpu,
    )
    elastic = min_num_proc is not None or max_num_proc is not None
    if elastic_timeout is not None and not elastic:
        raise ValueError("elastic_timeout applies to elastic jobs only: set min_num_proc or max_num_proc too.")
    if elastic:
        from hvd_spark._internal.common.sessions import is_connect
        from hvd_spark._internal.driver.sessions import active_session

        if is_connect(active_session(spark)):
            raise NotImplementedError(
                "min_num_proc / max_num_proc count the executors' task slots, which a Spark Connect client cannot "
                "see. Use a classic session, or a fixed num_proc with max_restarts."
            )
    if not elastic and not max_restarts:
        return launch(fn, args, kwargs, num_proc=num_proc, env=env, **launch_kwargs)
    return _run_with_restarts(
        fn, args, kwargs, num_proc, env, launch_kwargs, max_restarts, min_num_proc, max_num_proc, elastic_timeout
    )


def _run_with_restarts(
    fn, args, kwargs, num_proc, env, launch_kwargs, max_restarts, min_num_proc, max_num_proc, elastic_timeout
):
    """Attempts of ``fn`` until one succeeds or no restart is left, each from rank 0's latest commit:
    the fit's controller and policies (``ml/controller.py``), with ``hvd_spark.run``'s job; elastic
    attempts sized by the task slots there are, a lost executor dropped from the next attempt."""
    from hvd_spark._internal.common import settings
    from hvd_spark._internal.common.commits import CommitKeeper
    from hvd_spark._internal.ml.backend import SparkBackend
    from hvd_spark._internal.ml.controller import Controller, RunJob
    from hvd_spark._internal.ml.policies import Elastic, ElasticScaling, FailurePolicy, FixedScaling

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0. Received: max_restarts={max_restarts!r}.")
    elastic = None
    if min_num_proc is not None or max_num_proc is not None:
        low = 1 if min_num_proc is None else min_num_proc
        for name, value in (("min_num_proc", low), ("max_num_proc", max_num_proc), ("num_proc", num_proc)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        if max_num_proc is not None and low > max_num_proc:
            raise ValueError(f"min_num_proc must be at most max_num_proc. Received: {low} > {max_num_proc}.")
        if num_proc is not None and not low <= num_proc <= (max_num_proc or num_proc):
            raise ValueError(
                "num_proc (the first attempt's ranks) must be within min_num_proc and max_num_proc. Received: "
                f"num_proc={num_proc}, min_num_proc={low}, max_num_proc={max_num_proc}."
            )
        if max_restarts < 1:
            raise ValueError(
                "min_num_proc / max_num_proc need max_restarts >= 1: going on after a lost rank is a restart "
                f"on the slots left. Received: max_restarts={max_restarts}."
            )
        elastic = Elastic(
            low,
            max_num_proc,
            settings.ELASTIC_TIMEOUT.get(elastic_timeout),
            poll=settings.ELASTIC_POLL.get(),
            initial=num_proc,
        )
    keeper = CommitKeeper()
    backend = SparkBackend(num_proc=num_proc, env=env, on_event=keeper, **launch_kwargs)
    controller = Controller(
        backend,
        failure=FailurePolicy(max_restarts, holds_run=False),  # run() holds no run lease
        scaling=ElasticScaling(elastic) if elastic is not None else FixedScaling(),
        job=RunJob(fn, args, kwargs, keeper),
    )
    return controller.run().results
