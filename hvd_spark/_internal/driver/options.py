"""A launch's options, resolved and checked on the driver before any work starts: the slot
check, the backend, the rank layout, the timeouts and the warm ranks (:func:`resolve_launch_options`).
"""

from dataclasses import dataclass

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.choices import BACKENDS
from hvd_spark._internal.common.topology import GPU_CONF_HELP, plan_layout, task_cpus, task_gpu_amount
from hvd_spark._internal.driver.slots import Cluster, cluster_of


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
    use_gpu = _gpu_choice(use_gpu, cluster)
    layout_choice = settings.RANK_LAYOUT.get(
        layout, env=settings.environ(env), conf=conf, default=layout_default or settings.RANK_LAYOUT.default
    )
    _check_slots(num_proc, cluster)
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


def _gpu_choice(use_gpu: bool | None, cluster: Cluster) -> bool:
    """Whether the ranks use GPUs: ``use_gpu`` checked against the GPUs Spark schedules to the
    barrier tasks, or, where it is None, whether it schedules any."""
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True, False or None. Received: use_gpu={use_gpu!r}.")
    conf = cluster.conf
    gpus_per_task = task_gpu_amount(conf)
    if use_gpu is None:
        use_gpu = gpus_per_task > 0
    elif use_gpu and gpus_per_task <= 0 and cluster.slots is not None:  # a Connect session may not show conf
        raise ValueError(
            "use_gpu=True needs GPUs scheduled to the barrier tasks, but spark.task.resource.gpu.amount is "
            f"{conf.get('spark.task.resource.gpu.amount', None)!r} (master={cluster.master}). Set "
            f"{GPU_CONF_HELP}."
        )
    return use_gpu


def _check_slots(num_proc: int | None, cluster: Cluster) -> None:
    """The slot check: ``num_proc`` ranks fit the application's barrier task slots, and a session
    that cannot tell its slots has ``num_proc``."""
    slots = cluster.slots
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
            f"spark.task.cpus={task_cpus(cluster.conf)})."
        )
