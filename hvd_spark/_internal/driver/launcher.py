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
"""

import contextlib
import json
import logging
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.choices import BACKENDS
from hvd_spark._internal.common.outcomes import RankOutcome, TaskSpec
from hvd_spark._internal.common.topology import (
    GPU_CONF_HELP,
    barrier_refusal,
    executor_target,
    executors_settled,
    judge_slots,
    plan_layout,
    slots_from_master_url,
    stage_profiles_supported,
    task_cpus,
    task_gpu_amount,
    task_slots,
)
from hvd_spark._internal.driver.sessions import application_id, is_connect
from hvd_spark._internal.driver.supervisor import ClientWatch, JobReport, Supervisor, conclude
from hvd_spark.errors import JobCancelledError

logger = logging.getLogger(__name__)


class _SlotPool:
    """Task slots claimed by the hvd_spark jobs of this driver process, per Spark application.

    A barrier stage needs all its slots at once. When jobs of one driver run side by side
    (``CrossValidator(parallelism=2)``, fits from several threads) and together need more slots
    than the application has, the later ones wait here, before their ``start_timeout`` clock
    starts, instead of timing out while Spark holds their tasks back. The wait lasts as long as
    the jobs holding the slots, each of which is bounded by its own timeouts.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._used: dict[str, int] = {}

    @contextlib.contextmanager
    def claim(self, app: str, n: int, total: int, description: str):
        t0 = last_log = time.monotonic()
        with self._cond:
            while self._used.get(app, 0) and self._used[app] + n > total:
                if time.monotonic() - last_log >= 30 or last_log == t0:
                    logger.info(
                        "%s waits for %d task slots: %d of %d are held by other hvd_spark jobs of this "
                        "driver (waiting %.0fs)",
                        description,
                        n,
                        self._used[app],
                        total,
                        time.monotonic() - t0,
                    )
                    last_log = time.monotonic()
                self._cond.wait(5.0)
            self._used[app] = self._used.get(app, 0) + n
        try:
            yield
        finally:
            with self._cond:
                self._used[app] -= n
                self._cond.notify_all()


_SLOTS = _SlotPool()


@dataclass(frozen=True)
class Cluster:
    """What a launch needs to know of the running application."""

    app: str  # the application's id (the slot pool's key)
    master: str  # the master URL
    slots: int | None  # barrier task slots; None where a Connect session cannot tell
    conf: Any  # the application's settings: anything with get(key, default)
    executors: int | None = None  # executors registered (a classic session on a cluster master; local-cluster's URL)
    profiles: bool = False  # Spark gives a barrier stage its own task CPUs here (stage-level scheduling)


def cluster_of(spark, *, num_proc: int | None = None, start_timeout: float | None = None) -> Cluster:
    """The application behind ``spark``: from its SparkContext on a classic session; on Spark Connect
    from its runtime conf and, where the master URL does not say, from the partitions of a small
    ``range`` (Spark splits it into the application's default parallelism, its total cores).

    On a classic session with a cluster master the slots are those of the executors that registered
    (:func:`_registered_slots`, which waits a bounded time for them and raises ``ValueError`` when
    ``num_proc`` ranks could never be scheduled); ``start_timeout`` (as passed to the launch) bounds
    that wait."""
    if not is_connect(spark):
        sc = spark.sparkContext
        conf = sc.getConf()
        refusal = barrier_refusal(sc.master, conf)
        if refusal:
            raise ValueError(refusal)
        executors: int | None = None
        if slots_from_master_url(sc.master):
            slots = task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=task_cpus(conf))
            workers = _LOCAL_CLUSTER_WORKERS.match(sc.master.strip())
            executors = int(workers.group(1)) if workers else None
        else:
            slots = _registered_slots(sc, conf, num_proc, start_timeout)
            try:
                executors = _executor_count(sc)[0] or None
            except Exception as e:  # no JVM access to the scheduler: executors unknown (one rank per slot)
                logger.debug("counting the registered executors failed: %s", e)
        profiles = stage_profiles_supported(sc.master, sc.version, conf)
        return Cluster(sc.applicationId, sc.master, slots, conf, executors, profiles)
    conf = spark.conf
    master = conf.get("spark.master", None) or "?"
    refusal = barrier_refusal(master, _ConnectConf(conf))
    if refusal:
        raise ValueError(refusal)
    app = application_id(spark)
    cpus = task_cpus(conf)
    m = _LOCAL_N.match(master)
    if m or master.startswith("local-cluster"):
        return Cluster(app, master, task_slots(master, default_parallelism=0, task_cpus=cpus), conf)
    parallelism = _default_parallelism(spark)
    if parallelism is None:
        return Cluster(app, master, None, conf)
    slots = task_slots(master, default_parallelism=parallelism, task_cpus=cpus, cpu_count=parallelism)
    return Cluster(app, master, slots, conf)


_LOCAL_N = re.compile(r"^local(\[\d+(,\s*\d+)?\])?$")
_LOCAL_CLUSTER_WORKERS = re.compile(r"^local-cluster\[\s*(\d+)\s*,")


class _ConnectConf:
    """A Connect session's runtime conf, read without failing on keys the server does not show."""

    def __init__(self, conf):
        self._conf = conf

    def get(self, key, default=None):
        try:
            return self._conf.get(key, default)
        except Exception:  # a server that refuses to show a static conf: as unset
            return default


_SETTLED: dict[str, int] = {}  # application id -> executors once its count was complete (standalone)
_SLOT_POLL = 0.25  # seconds between two counts of the registered executors
_SLOT_LOG_EVERY = 10.0


def _executor_count(sc) -> tuple[int, int]:
    """The executors registered with the application and their barrier task slots: the number
    Spark's own barrier check uses (``SparkContext.maxNumConcurrentTasks`` of the default resource
    profile: each active executor's cores / spark.task.cpus, fewer where its GPUs or other resources
    allow fewer tasks)."""
    from hvd_spark._internal.common import internals

    return internals.spark_executor_slots(sc)


def _registered_slots(sc, conf, num_proc: int | None, start_timeout: float | None) -> int:
    """The barrier task slots of a classic application on a cluster master, counted on the executors
    that registered. Waits for them up to ``HVD_SPARK_EXECUTOR_WAIT`` seconds (default 30, never
    longer than start_timeout): until there are enough for ``num_proc``, every executor the conf asks
    for has registered, or (standalone) their count held still for a few seconds. Raises ValueError
    when ``num_proc`` ranks could never be scheduled, naming the numbers (:func:`judge_slots`)."""
    cpus = task_cpus(conf)
    try:
        reading = _executor_count(sc)
    except Exception as e:  # no JVM access to the scheduler: the application's default parallelism
        logger.debug("counting the registered executors failed (%s): slots from defaultParallelism", e)
        return task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=cpus)
    limit = min(
        settings.EXECUTOR_WAIT.get(conf=conf),
        settings.START_TIMEOUT.get(start_timeout, conf=conf),
    )
    target = executor_target(sc.master, conf, cpus)
    app = sc.applicationId
    t0 = changed = last_log = time.monotonic()
    complete = logged = False
    while True:
        executors, slots = reading
        now = time.monotonic()
        # Complete: every executor there will be has registered (or as many as an earlier count of
        # this standalone application found complete).
        complete = executors_settled(None, executors, slots, target, now - changed, settings.EXECUTORS_SETTLE) or (
            target.settles and executors >= _SETTLED.get(app, 1 << 30)
        )
        if complete or (num_proc is not None and slots >= num_proc) or now - t0 >= limit:
            break
        if not logged or now - last_log >= _SLOT_LOG_EVERY:
            asked = (
                f"{target.executors} asked for: {target.source}" if target.executors is not None else "count settles"
            )
            logger.info(
                "waiting up to %.0fs for the executors to register (%s): %d registered with %d task slots "
                "(spark.task.cpus=%d), num_proc=%s (%.0fs)",
                limit,
                asked,
                executors,
                slots,
                cpus,
                num_proc if num_proc is not None else "all slots",
                now - t0,
            )
            last_log, logged = now, True
        time.sleep(_SLOT_POLL)
        try:
            new = _executor_count(sc)
        except Exception as e:
            logger.debug("counting the registered executors failed: %s", e)
            new = reading
        if new != reading:
            changed = time.monotonic()
        reading = new
    waited = time.monotonic() - t0
    executors, slots = reading
    if complete and target.settles:
        _SETTLED[app] = max(executors, _SETTLED.get(app, 0))
    log = logger.info if waited >= 0.5 else logger.debug
    log("%d executors registered with %d task slots (spark.task.cpus=%d) after %.1fs", executors, slots, cpus, waited)
    verdict = judge_slots(
        num_proc,
        executors=executors,
        slots=slots,
        target=target,
        settled=complete,
        waited=waited,
        master=sc.master,
        task_cpus=cpus,
        default_parallelism=conf.get("spark.default.parallelism", None),
        wait_setting=f"{settings.ENV_EXECUTOR_WAIT} or {settings.CONF_EXECUTOR_WAIT}, now {limit:.0f}s",
    )
    if verdict.error:
        raise ValueError(verdict.error)
    if verdict.warning:
        logger.warning("%s", verdict.warning)
    return verdict.slots


def _default_parallelism(spark) -> int | None:
    """The application's default parallelism seen through Spark Connect, or None if it cannot be told."""
    conf = _ConnectConf(spark.conf)
    if conf.get("spark.sql.leafNodeDefaultParallelism", None) or conf.get("spark.default.parallelism", None):
        return None  # range() is split by that setting, not by the cores
    from pyspark.sql import functions as F

    try:
        row = spark.range(0, 1 << 16).select(F.max(F.spark_partition_id()).alias("p")).collect()[0]
        return int(row["p"]) + 1
    except Exception as e:  # the server refused the query: the caller asks for num_proc
        logger.debug("counting the default parallelism failed: %s", e)
        return None


def _driver_address(sc) -> str:
    conf = sc.getConf()
    host = conf.get("spark.driver.host", None) or "127.0.0.1"
    return host


def resolve_backend(backend: str | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None) -> str:
    """The Horovod controller, ``"gloo"`` or ``"mpi"``, from ``backend`` or horovod's
    ``use_gloo`` / ``use_mpi`` flags (kept for ``horovod.spark.run`` compatibility)."""
    if use_gloo and use_mpi:
        raise ValueError(
            "Choose one controller: use_gloo=True or use_mpi=True, not both. Received: use_gloo=True, use_mpi=True."
        )
    flag = "mpi" if use_mpi else ("gloo" if use_gloo else None)
    if backend is not None and flag is not None and backend != flag:
        raise ValueError(
            f"backend={backend!r} contradicts use_{flag}=True. Pass one of them: backend is the same choice."
        )
    chosen = backend or flag or "gloo"
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' or 'mpi'. Received: backend={chosen!r}.")
    if chosen == "mpi" and not _mpi_available():
        raise ValueError(
            "backend='mpi' (use_mpi=True) needs Horovod built with MPI and mpirun on the PATH, and this "
            "installation has not both. Install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) and rerun "
            "scripts/setup.sh, or use the Gloo controller (backend='gloo')."
        )
    return chosen


_MPI_AVAILABLE: bool | None = None


def _mpi_available() -> bool:
    """Whether Horovod was built with MPI and mpirun exists; asked of a separate interpreter, so that
    the driver does not import TensorFlow (cached for the process)."""
    global _MPI_AVAILABLE
    if _MPI_AVAILABLE is None:
        import shutil
        import subprocess
        import sys

        code = "import horovod.tensorflow as hvd; print(bool(hvd.mpi_built()))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            built = out.returncode == 0 and out.stdout.strip().endswith("True")
        except subprocess.TimeoutExpired:
            built = False
        _MPI_AVAILABLE = built and shutil.which("mpirun") is not None
    return _MPI_AVAILABLE


@dataclass(frozen=True)
class LaunchOptions:
    """Everything a launch needs that can be known on the driver, resolved and checked before any
    work starts (:func:`resolve_launch_options`); ``fit`` resolves them before writing data."""

    num_proc: int
    slots: int  # the application's barrier task slots (num_proc where a Connect session cannot tell)
    backend: str
    num_threads: int
    start_timeout: float
    timeout: float | None
    abort_grace: float
    gloo_timeout: float
    env: dict[str, str] | None = None
    heartbeat_timeout: float = settings.HEARTBEAT_TIMEOUT.default
    master: str = "?"  # the master URL, for messages
    app: str = ""  # the application's id
    warm: bool = True  # ranks forked by warm servers (see warm.py) where they can serve
    warm_set: bool = False  # warm came from the argument, the driver's environment or conf (not the default)
    stall_timeout: float | None = None  # seconds a rank may go without progress (None: no watchdog)
    use_gpu: bool = False  # each rank gets its task's Spark-assigned GPUs (CUDA_VISIBLE_DEVICES)
    task_cpus: int | None = None  # CPUs each barrier task asks for (a TaskResourceProfile); None: spark.task.cpus
    layout: str = "slot"  # the rank layout it was planned with (settings.RANK_LAYOUT), and why, for the log
    layout_why: str = ""
    slots_each: int = 1  # task slots one rank holds (its profile's CPUs / spark.task.cpus)

    @property
    def forks_warm(self) -> bool:
        """Whether the job's ranks are forked by warm servers (task/warm.py): asked for, Gloo (mpirun
        starts its own ranks), and no GPUs (a rank forked from a process that imported TensorFlow
        must not meet CUDA). The one place this is decided; prewarm and the tasks follow it."""
        return self.warm and self.backend == "gloo" and not self.use_gpu


def resolve_launch_options(
    spark,
    *,
    num_proc: int | None,
    backend: str | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    warm: bool | None = None,
    stall_timeout: float | None = None,
    stall_default: float | None = None,
    use_gpu: bool | None = None,
    layout: str | None = None,
    layout_default: str | None = None,
) -> LaunchOptions:
    """Checks a launch's options against the application behind ``spark`` (classic or Connect):
    the one place for the slot check. ``stall_default`` is the stall watchdog's timeout when neither
    ``stall_timeout`` nor ``HVD_SPARK_STALL_TIMEOUT`` sets one (the estimator's 300 s; None for run).
    ``layout`` (``host`` or ``slot``; else ``HVD_SPARK_RANK_LAYOUT``, else ``layout_default``, else
    the setting's default) decides how many ranks run where ``num_proc`` is None and their threads
    (:func:`~hvd_spark._internal.common.topology.plan_layout`); ``num_threads`` overrides the threads."""
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise ValueError(f"num_proc must be a positive integer. Received: num_proc={num_proc!r}.")
    cluster = cluster_of(spark, num_proc=num_proc, start_timeout=start_timeout)
    conf, slots = cluster.conf, cluster.slots
    if env is not None and (
        not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must map str to str.")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be a positive integer. Received: num_threads={num_threads!r}.")
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True, False or None. Received: use_gpu={use_gpu!r}.")
    gpus_per_task = task_gpu_amount(conf)
    if use_gpu is None:
        use_gpu = gpus_per_task > 0
    elif use_gpu and gpus_per_task <= 0 and cluster.slots is not None:  # a Connect session may not show conf
        raise ValueError(
            "use_gpu=True needs GPUs scheduled to the barrier tasks, but spark.task.resource.gpu.amount is "
            f"{conf.get('spark.task.resource.gpu.amount', None)!r} (master={cluster.master}). Set "
            f"{GPU_CONF_HELP}."
        )
    layout_choice = settings.RANK_LAYOUT.get(
        layout, env=settings.environ(env), conf=conf, default=layout_default or settings.RANK_LAYOUT.default
    )
    if num_proc is None and slots is None:
        raise ValueError(
            "num_proc is required on this Spark Connect session: hvd_spark could not tell how many task "
            f"slots the application has (master={cluster.master}; spark.default.parallelism or "
            "spark.sql.leafNodeDefaultParallelism is set, or the server refused the query that counts them). "
            "Pass num_proc (at most the cores of the executors divided by spark.task.cpus)."
        )
    if slots is not None and num_proc is not None and num_proc > slots:
        raise ValueError(
            f"num_proc must be at most the number of task slots ({slots}) for a barrier stage. Received: "
            f"num_proc={num_proc}. Lower num_proc or add executors / cores (master={cluster.master}, "
            f"spark.task.cpus={task_cpus(conf)})."
        )
    plan = plan_layout(
        layout_choice,
        master=cluster.master,
        num_proc=num_proc,
        slots=slots if slots is not None else int(num_proc or 1),
        executors=cluster.executors,
        task_cpus=task_cpus(conf),
        profiles=cluster.profiles,
        use_gpu=use_gpu,
    )
    num_proc = plan.num_proc
    chosen_backend = resolve_backend(backend, use_gloo, use_mpi)
    if use_gpu and chosen_backend == "mpi":
        raise NotImplementedError(
            "use_gpu with backend='mpi' is not built yet: mpirun starts all ranks of a host with one "
            "environment, and hvd_spark does not yet give each of them its own task's GPU. Use backend='gloo' "
            "(NCCL still carries the GPU allreduce when Horovod has it)."
        )
    warm_choice = settings.WARM.get(warm, env=settings.environ(env), conf=conf, default=None)
    return LaunchOptions(
        num_proc=num_proc,
        slots=slots if slots is not None else num_proc,
        master=cluster.master,
        app=cluster.app,
        backend=chosen_backend,
        num_threads=num_threads if num_threads is not None else plan.threads,
        start_timeout=settings.START_TIMEOUT.get(start_timeout, conf=conf),
        timeout=settings.parse_seconds("timeout", timeout) if timeout is not None else None,
        abort_grace=settings.ABORT_GRACE.get(conf=conf),
        gloo_timeout=settings.GLOO_TIMEOUT.get(conf=conf),
        heartbeat_timeout=max(
            2 * settings.HEARTBEAT_INTERVAL,
            settings.HEARTBEAT_TIMEOUT.get(conf=conf),
        ),
        env=dict(env) if env is not None else None,
        # The argument, else the driver's environment (with the job's env on top), else conf; when none
        # of them says, each executor's own HVD_SPARK_WARM may still turn it off (warm_set=False).
        warm=warm_choice if warm_choice is not None else settings.WARM.default,
        warm_set=warm_choice is not None,
        stall_timeout=settings.stall_timeout_setting(stall_timeout, stall_default, conf=conf),
        use_gpu=use_gpu,
        task_cpus=plan.task_cpus,
        layout=layout_choice,
        layout_why=plan.why,
        slots_each=max(1, (plan.task_cpus or 0) // task_cpus(conf)),
    )


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
    from pyspark.sql import SparkSession

    payload = pickled_payload(fn, args, kwargs)
    spark = spark or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
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
    with _SLOTS.claim(options.app, options.num_proc * options.slots_each, options.slots, description):
        logger.info(
            "starting %d ranks (%s) on %s: %s", options.num_proc, options.backend, options.master, options.layout_why
        )
        if is_connect(spark):
            return _launch_connect(
                spark, payload, options, on_event=on_event, description=description, channel=channel, on_log=on_log
            )
        return _launch_classic(
            spark.sparkContext, payload, options, on_event=on_event, description=description, on_log=on_log
        )


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


def _task_spec(options: LaunchOptions, payload: bytes, driver_addr: str, token: str) -> TaskSpec:
    from hvd_spark._internal.common.logs import rank_env_defaults

    return TaskSpec(
        driver_addr=driver_addr,
        token=token,
        payload=payload,
        backend=options.backend,
        env=rank_env_defaults(options.env),
        num_threads=int(options.num_threads),
        gloo_timeout=options.gloo_timeout,
        abort_grace=options.abort_grace,
        heartbeat_timeout=options.heartbeat_timeout,
        warm=options.forks_warm,
        warm_set=options.warm_set,
        app=options.app,
        start_timeout=options.start_timeout,
        use_gpu=options.use_gpu,
    )


class _Stage:
    """The barrier stage's blocking call, in a background thread; its rows or its error."""

    def __init__(
        self, call: Callable[[], list], name: str, inheritable: bool, on_end: Callable[[], None] | None = None
    ):
        from pyspark import InheritableThread

        self.rows: list | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

        def run():
            try:
                self.rows = call()
            except BaseException as e:  # noqa: BLE001 - the launcher reports it with what it knows
                self.error = e
            finally:
                self._done.set()  # before on_end: a woken loop sees the stage ended
                if on_end is not None:
                    on_end()  # the waiting loop sees the end now, not at its next poll

        self.thread = (InheritableThread if inheritable else threading.Thread)(target=run, name=name)
        self.thread.daemon = True
        self.thread.start()

    def alive(self) -> bool:
        return not self._done.is_set()


def task_cpus_profile(cpus: int):
    """A ``ResourceProfile`` whose tasks each ask for ``cpus`` CPUs (a TaskResourceProfile: the executors
    stay as they are; Spark schedules fewer of these tasks on each)."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    return ResourceProfileBuilder().require(TaskResourceRequests().cpus(int(cpus))).build


def _launch_classic(
    sc, payload: bytes, options: LaunchOptions, *, on_event, description: str, on_log=None
) -> list[Any]:
    """A classic session: the driver service and its supervisor run here, on the Spark driver."""
    from hvd_spark._internal.driver.service import DriverService

    num_proc = options.num_proc
    service = DriverService(num_proc, on_event=on_event, on_log=on_log)
    port = service.start()
    spec = _task_spec(options, payload, f"{_driver_address(sc)}:{port}", service.token)
    group = f"hvd_spark-{uuid.uuid4().hex[:12]}"

    def task_fn(_):
        from hvd_spark._internal.task.barrier import run_task

        return run_task(spec)

    def stage():
        sc.setJobGroup(group, f"{description}: {num_proc} Horovod ranks", interruptOnCancel=True)
        rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task_fn)
        if options.task_cpus:  # each barrier task asks for its rank's cores (stage-level scheduling)
            rdd = rdd.withResources(task_cpus_profile(options.task_cpus))
        return rdd.collect()

    t0 = time.monotonic()
    supervisor = Supervisor(service, options, where=sc.master)
    job = _Stage(stage, f"{group}-submit", inheritable=True, on_end=service.wake)
    cancelled = False
    try:
        try:
            while job.alive():
                service.wait(0.2)
                supervisor.step()
                if supervisor.should_cancel() and not cancelled:
                    # Tasks that do not react to the abort are cancelled through Spark.
                    logger.warning("cancelling Spark job group %s", group)
                    sc.cancelJobGroup(group)
                    cancelled = True
                if cancelled and supervisor.should_give_up():
                    logger.error("Spark job group %s did not stop after cancellation", group)
                    break
        except KeyboardInterrupt:
            supervisor.interrupt("interrupted on the driver")
            sc.cancelJobGroup(group)
            _wait_for_ranks(service, group)
            raise
        if job.error is not None and not job.alive():  # failed or cancelled: its ranks must be gone first
            if not cancelled:
                supervisor.interrupt("the Spark job ended with an error")
            _wait_for_ranks(service, group)
    finally:
        if not job.alive() and job.error is None:  # (a failed stage's ranks were waited for above)
            # The tasks closed their connections before the stage ended: read what they sent last
            # (a stalled rank's stack, the last output lines) before the service closes them.
            service.wait_until_stopped(2.0, silent_after=options.heartbeat_timeout)
        service.stop()
    if job.error is not None and not cancelled and _was_cancelled(job.error):
        raise JobCancelledError(
            f"the Spark job of {description} was cancelled (outside hvd_spark: cancelAllJobs, its job group "
            f"{group}, or an interrupt); its ranks have stopped. Spark said: {str(job.error).strip().splitlines()[0]}"
        ) from job.error
    records = [cloudpickle.loads(r) for r in job.rows or []]
    return conclude(
        records,
        supervisor.report(),
        num_proc=num_proc,
        description=description,
        elapsed=time.monotonic() - t0,
        stage_error=job.error,
    )


_SPARK_CANCELLED = re.compile(
    r"Job \d+ cancelled|cancelled job group|cancellation of all jobs|SPARK_JOB_CANCELLED|"
    r"cancelled because SparkContext was shut down|Job aborted due to stage cancellation|"
    r"Stage \d+ cancelled|cancelled as part of cancellation",
    re.IGNORECASE,
)


def _was_cancelled(error: BaseException) -> bool:
    """Whether a barrier stage's error is Spark's cancellation of its job (not a task's failure whose
    text happens to mention a cancelled operation): Spark's own wording, before any task traceback."""
    head = str(error).split("Traceback (most recent call last)", 1)[0]
    return bool(_SPARK_CANCELLED.search(head[:4000]))


def _wait_for_ranks(service, group: str) -> None:
    """After a failed or cancelled job: returns once every task and rank process of it has exited (its
    connection to the driver closed), or after ``HVD_SPARK_STOP_WAIT`` seconds, naming what is left."""
    from hvd_spark._internal.common import settings

    # Tasks silent for two heartbeats (a lost host, a dead executor: their connections may stay half
    # open) and their ranks are not waited for.
    stop_wait = settings.STOP_WAIT.get()
    left = service.wait_until_stopped(stop_wait, silent_after=2 * settings.HEARTBEAT_INTERVAL + 1)
    if left:
        logger.error(
            "%s of Spark job group %s still running %.0fs after the job ended; they stop when they next reach "
            "their task or the store",
            ", ".join(left),
            group,
            stop_wait,
        )


def _launch_connect(spark, payload: bytes, options: LaunchOptions, *, on_event, description: str, channel, on_log=None):
    """Spark Connect: the driver service and supervisor run in the first barrier task
    (``coordinator.py``); this client submits the stage under a tag (to interrupt it), shows the
    channel's records and decides the result from the stage's rows."""
    import pandas as pd

    from hvd_spark._internal.common.channel import ChannelReader, show
    from hvd_spark._internal.driver.coordinator import OUTCOME, RECORDS, REPORT, ConnectJob, run_connect_task

    num_proc = options.num_proc
    tag = f"hvd_spark-{uuid.uuid4().hex[:12]}"
    reader = live = None
    if channel is not None:
        store, folder = channel
        path = posixpath.join(folder, tag)
        reader, live = ChannelReader(store, path), (store._job_config(), path)
    job_spec = ConnectJob(_task_spec(options, payload, "", ""), options, options.master, live)

    def task_fn(batches):
        for _ in batches:  # one row per task: only the task matters
            pass
        rows = run_connect_task(job_spec)
        if rows:  # an MPI task that only held its slot has none (an empty binary column does not convert)
            yield pd.DataFrame({"kind": [k for k, _ in rows], "data": [d for _, d in rows]})

    def stage():
        spark.addTag(tag)  # tags are per thread: this one marks the stage's query only
        try:
            df = spark.range(0, num_proc, 1, num_proc)
            return df.mapInPandas(task_fn, "kind string, data binary", barrier=True).collect()
        finally:
            spark.removeTag(tag)

    t0 = time.monotonic()
    job = _Stage(stage, f"{tag}-submit", inheritable=False)

    def interrupt(why: str) -> None:
        logger.warning("interrupting the Spark Connect operations tagged %s: %s", tag, why)
        spark.interruptTag(tag)

    watch = ClientWatch(options, num_proc, options.master, interrupt, live=reader is not None)
    try:
        while job.alive():
            job.thread.join(1.0)
            if reader is not None:
                news = reader.poll()
                show(news, on_event, on_log)
                watch.see(news)
            if not watch.step():
                logger.error("the Spark Connect operations tagged %s did not stop after the interruption", tag)
                break
    except KeyboardInterrupt:
        watch.interrupt("interrupted on the client")
        raise
    finally:
        if reader is not None:
            show(reader.poll(), on_event, on_log)
            reader.remove()
    records: list[RankOutcome] = []
    report, kept = JobReport(), []
    for row in job.rows or []:
        kind, data = row["kind"], bytes(row["data"])
        if kind == OUTCOME:
            records.append(cloudpickle.loads(data))
        elif kind == REPORT:
            report = cloudpickle.loads(data)
        elif kind == RECORDS:
            kept = json.loads(data)
    show(kept, on_event, on_log)
    if watch.problem is not None:
        raise watch.problem
    return conclude(
        records,
        report,
        num_proc=num_proc,
        description=description,
        elapsed=time.monotonic() - t0,
        stage_error=job.error,
    )
