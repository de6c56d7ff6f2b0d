"""Pure functions that decide the layout of a Horovod job: slots, ranks, environment.

Nothing here touches Spark, sockets or the process environment, so all of it is tested
without a cluster.
"""

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where one Spark barrier task sits in the Horovod job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str


def assign_ranks(hosts: Sequence[str]) -> list[RankInfo]:
    """Assigns Horovod ranks to barrier tasks from the host each task runs on.

    Ranks are contiguous per host (hosts in order of first appearance, tasks in partition
    order within a host), which is the layout Horovod's hierarchical operations expect.

    Args:
        hosts: ``hosts[i]`` is the host key of barrier task (partition) ``i``.

    Returns:
        ``result[i]`` is the :class:`RankInfo` of task ``i``.
    """
    if not hosts:
        raise ValueError("assign_ranks needs at least one host. Received: [].")
    order: list[str] = []
    tasks_of: dict[str, list[int]] = {}
    for task, host in enumerate(hosts):
        if host not in tasks_of:
            order.append(host)
            tasks_of[host] = []
        tasks_of[host].append(task)
    size = len(hosts)
    infos: list[RankInfo | None] = [None] * size
    rank = 0
    for host in order:
        local_size = len(tasks_of[host])
        for local_rank, task in enumerate(tasks_of[host]):
            # Hosts that have this local rank, in host order: cross communicator.
            peers = [h for h in order if len(tasks_of[h]) > local_rank]
            infos[task] = RankInfo(
                rank=rank,
                size=size,
                local_rank=local_rank,
                local_size=local_size,
                cross_rank=peers.index(host),
                cross_size=len(peers),
                host=host,
            )
            rank += 1
    return infos  # type: ignore[return-value]


def horovod_env(
    info: RankInfo,
    *,
    rendezvous_addr: str,
    rendezvous_port: int,
    iface: str,
    controller: str = "gloo",
    gloo_timeout: float = 120.0,
    num_threads: int = 1,
) -> dict[str, str]:
    """The environment that makes ``hvd.init()`` join the job as ``info.rank`` over Gloo.

    Args:
        info: the rank's place in the job.
        rendezvous_addr, rendezvous_port: where rank 0's task serves Gloo's HTTP rendezvous.
        iface: network interface that carries this task's address (``lo`` on one machine).
        controller: ``"gloo"``; MPI jobs get their ranks from ``mpirun`` instead.
        gloo_timeout: seconds Gloo waits for its peers while connecting.
        num_threads: intra-op threads for the rank's compute libraries (TF, OpenMP).
    """
    if controller != "gloo":
        raise ValueError(f"horovod_env builds Gloo environments only. Received: controller={controller!r}.")
    env = {
        "HOROVOD_RANK": str(info.rank),
        "HOROVOD_SIZE": str(info.size),
        "HOROVOD_LOCAL_RANK": str(info.local_rank),
        "HOROVOD_LOCAL_SIZE": str(info.local_size),
        "HOROVOD_CROSS_RANK": str(info.cross_rank),
        "HOROVOD_CROSS_SIZE": str(info.cross_size),
        "HOROVOD_HOSTNAME": info.host,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(int(rendezvous_port)),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(max(1, round(gloo_timeout)))),
    }
    env.update(threads_env(num_threads))
    return env


# What torch.distributed's env:// init and a function written for torchrun / TorchDistributor read
# (torch/distributed/run.py's list). hvd_spark sets them on every rank; warm servers are not keyed by them.
TORCH_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
)


def node_of(info: RankInfo, ranks: Sequence[RankInfo]) -> tuple[int, int]:
    """``(node, nodes)``: the index of ``info``'s host among the job's hosts in rank order (a host is
    torchrun's node: :func:`assign_ranks` gives each one contiguous ranks) and how many there are."""
    hosts: list[str] = []
    for r in sorted(ranks, key=lambda r: r.rank):
        if r.host not in hosts:
            hosts.append(r.host)
    return hosts.index(info.host), len(hosts)


def torch_env(
    info: RankInfo,
    *,
    node: int,
    nodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    iface: str | None = None,
) -> dict[str, str]:
    """The environment that makes ``torch.distributed.init_process_group()`` (``env://``) join the job
    as ``info.rank``, with the variables ``torchrun`` gives its workers (what a function written for
    ``TorchDistributor`` reads), one host being one node.

    Args:
        info: the rank's place in the job; ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` are its host's.
        node, nodes: its host's index among the job's hosts, and their count (:func:`node_of`).
        master_addr, master_port: where rank 0's ``TCPStore`` listens (rank 0's task reserved the port).
        run_id: the job's id (``TORCHELASTIC_RUN_ID``: Lightning then takes the variables above as they
            are, as under ``torchrun``).
        iface: the interface that carries the rank's address: Gloo's (``GLOO_SOCKET_IFNAME``).
    """
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(int(master_port)),
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_size),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(info.rank),
        "ROLE_WORLD_SIZE": str(info.size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id,
        # No torchelastic agent hosts a store here: rank 0's init_process_group serves it on MASTER_PORT.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


def mpi_torch_env(rank: int, node_sizes: Sequence[int], environ: dict[str, str]) -> dict[str, str]:
    """:func:`torch_env` for rank ``rank`` of an MPI job. mpirun lays the ranks out as
    :func:`assign_ranks` does (contiguous per host, hosts in rank order), ``node_sizes[i]`` ranks on
    the ``i``-th host; ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID`` come from rank 0's
    task through mpirun (``environ``)."""
    start = 0
    for node, local_size in enumerate(node_sizes):
        if rank < start + local_size:
            info = RankInfo(rank, sum(node_sizes), rank - start, local_size, node, len(node_sizes), "")
            return torch_env(
                info,
                node=node,
                nodes=len(node_sizes),
                master_addr=environ["MASTER_ADDR"],
                master_port=int(environ["MASTER_PORT"]),
                run_id=environ["TORCHELASTIC_RUN_ID"],
            )
        start += local_size
    raise ValueError(f"rank {rank} is not on any of the job's hosts. Received: node_sizes={list(node_sizes)}.")


def threads_env(num_threads: int) -> dict[str, str]:
    """Caps the compute threads of one rank so that ranks sharing a host do not oversubscribe it."""
    n = str(max(1, int(num_threads)))
    return {"OMP_NUM_THREADS": n, "TF_NUM_INTRAOP_THREADS": n, "TF_NUM_INTEROP_THREADS": n, "HVD_SPARK_NUM_THREADS": n}


_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")


def task_cpus(conf) -> int:
    """CPUs per Spark task (``spark.task.cpus``, default 1) from a SparkConf or anything with ``get``.

    The one place that reads it: it sizes barrier slots, rank threads and transform threads.
    """
    raw = conf.get("spark.task.cpus", "1") or "1"
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"spark.task.cpus must be a positive integer. Received: {raw!r}.") from None
    if value < 1:
        raise ValueError(f"spark.task.cpus must be a positive integer. Received: {raw!r}.")
    return value


def task_slots(master: str, *, default_parallelism: int, task_cpus: int = 1, cpu_count: int | None = None) -> int:
    """How many barrier tasks can run at once on this Spark application.

    Local masters are read from the master URL. For other masters this is the fallback where the
    registered executors cannot be counted (a Spark Connect session, a JVM that refuses the call):
    ``defaultParallelism``, the executors' total cores unless ``spark.default.parallelism`` is set
    (see :func:`judge_slots` for the count used on a classic session).

    Args:
        master: the Spark master URL.
        default_parallelism: ``SparkContext.defaultParallelism``.
        task_cpus: ``spark.task.cpus``.
        cpu_count: cores of this machine (for ``local[*]``); defaults to ``os.cpu_count()``.
    """
    task_cpus = max(1, int(task_cpus))
    m = _LOCAL.match(master.strip())
    if m:
        n = m.group(1)
        if n is None:
            cores = 1
        elif n == "*":
            cores = cpu_count or os.cpu_count() or 1
        else:
            cores = int(n)
        return max(1, cores // task_cpus) if cores >= task_cpus else 0
    m = _LOCAL_CLUSTER.match(master.strip())
    if m:
        workers, cores = int(m.group(1)), int(m.group(2))
        return workers * (cores // task_cpus)
    return max(0, int(default_parallelism) // task_cpus)


def is_local_master(master: str) -> bool:
    """Spark's own test for a master of one JVM (``local``, ``local[...]``; not ``local-cluster``)."""
    m = master.strip()
    return m == "local" or m.startswith("local[")


def slots_from_master_url(master: str) -> bool:
    """Whether :func:`task_slots` reads the slots exactly from the master URL (local, local-cluster);
    on every other master they are counted on the executors that registered."""
    m = master.strip()
    return bool(_LOCAL.match(m) or _LOCAL_CLUSTER.match(m))


def _conf_int(conf, key: str) -> int | None:
    raw = conf.get(key, None)
    if raw is None or str(raw).strip() == "":
        return None
    try:
        return int(str(raw).strip())
    except ValueError:
        return None


def barrier_refusal(master: str, conf) -> str | None:
    """Why Spark refuses every barrier stage of this application, or None.

    Spark does not run barrier stages with dynamic allocation on (``BarrierJobRunWithDynamicAllocation
    Exception``, SPARK-24942), which it counts as on for every master but ``local`` / ``local[...]``
    (there only with ``spark.dynamicAllocation.testing``). hvd_spark says so before any work.
    """
    if str(conf.get("spark.dynamicAllocation.enabled", "false") or "false").strip().lower() != "true":
        return None
    testing = str(conf.get("spark.dynamicAllocation.testing", "false") or "false").strip().lower() == "true"
    if is_local_master(master) and not testing:
        return None
    return (
        f"Spark does not run barrier stages with dynamic allocation (spark.dynamicAllocation.enabled=true, "
        f"master={master}), and hvd_spark runs its ranks as one barrier stage: the job would fail at once "
        "with BarrierJobRunWithDynamicAllocationException. Start the application with "
        "spark.dynamicAllocation.enabled=false and a fixed set of executors (spark.executor.instances and "
        "spark.executor.cores on YARN and Kubernetes, spark.cores.max and spark.executor.cores on standalone)."
    )


@dataclass(frozen=True)
class ExecutorTarget:
    """The executors an application asked for, as far as its conf tells (dynamic allocation off)."""

    executors: int | None  # how many; None where the conf does not say (standalone without spark.cores.max)
    source: str  # where that number comes from, for messages
    slots_each: int | None  # task slots of one executor when the conf tells (spark.executor.cores)
    settles: bool  # a count that stopped changing is complete (standalone: the Master grants at once)
    fix: str  # the settings that give the application more slots, for messages


def executor_target(master: str, conf, task_cpus: int = 1) -> ExecutorTarget:
    """What executors the application behind ``master`` and ``conf`` waits for.

    YARN and Kubernetes start ``spark.executor.instances`` executors (default 2) of
    ``spark.executor.cores`` cores (default 1) as the cluster grants them. A standalone Master grants
    an application, when it registers, executors of ``spark.executor.cores`` (default: all free cores
    of a Worker) until ``spark.cores.max`` (default: every free core); ``spark.executor.instances``
    does not count there.
    """
    m = master.strip()
    cpus = max(1, int(task_cpus))
    cores = _conf_int(conf, "spark.executor.cores")
    if m == "yarn" or m.startswith("k8s://"):
        per_executor = (cores or 1) // cpus
        instances = _conf_int(conf, "spark.executor.instances")
        fix = "more executors or cores per executor (spark.executor.instances, spark.executor.cores)"
        if instances is not None:
            return ExecutorTarget(instances, f"spark.executor.instances={instances}", per_executor, False, fix)
        return ExecutorTarget(2, "spark.executor.instances unset: Spark's default of 2", per_executor, False, fix)
    each = cores // cpus if cores else None
    fix = "more cores (spark.cores.max, spark.executor.cores; Workers with free cores)"
    cores_max = _conf_int(conf, "spark.cores.max")
    if m.startswith("spark://") and cores_max and cores:
        source = f"spark.cores.max={cores_max} / spark.executor.cores={cores}"
        return ExecutorTarget(cores_max // cores, source, each, True, fix)
    return ExecutorTarget(None, "", each, True, fix)


def executors_settled(
    num_proc: int | None, executors: int, slots: int, target: ExecutorTarget, stable_for: float, settle: float
) -> bool:
    """Whether the registered executors are all a launch needs to wait for: enough slots for
    ``num_proc``, every executor the application asked for, or (standalone, or a count the conf
    does not tell) a count that held still for ``settle`` seconds."""
    if executors < 1:
        return False
    if num_proc is not None and slots >= num_proc:
        return True
    if target.executors is not None and executors >= target.executors:
        return True
    return target.settles and stable_for >= settle


@dataclass(frozen=True)
class SlotVerdict:
    """The slots a launch counts on, or why it cannot start."""

    slots: int  # the application's barrier task slots for this launch (num_proc defaults to them)
    error: str | None = None  # the launch can never be scheduled (or num_proc cannot default): the message
    warning: str | None = None  # the launch goes on, but not every executor asked for has registered


def judge_slots(
    num_proc: int | None,
    *,
    executors: int,
    slots: int,
    target: ExecutorTarget,
    settled: bool,
    waited: float,
    master: str,
    task_cpus: int,
    default_parallelism: str | None = None,
    wait_setting: str = "HVD_SPARK_EXECUTOR_WAIT",
) -> SlotVerdict:
    """Decides a launch's task slots from the executors that registered.

    Args:
        num_proc: the ranks asked for; None: as many as there are slots.
        executors, slots: the executors registered and their barrier task slots (Spark's own count,
            ``maxNumConcurrentTasks`` of the default resource profile).
        target: what the application asked for (:func:`executor_target`).
        settled: whether the count is complete (:func:`executors_settled`) or the wait ran out.
        waited: seconds waited for them.
        master, task_cpus, default_parallelism: for messages (``spark.default.parallelism`` as set).
        wait_setting: the setting that makes the wait longer, for messages.

    A launch that asks for more ranks than can ever be scheduled is refused: more than the slots
    of a complete set of executors, or, while some are still missing, more than all the executors
    asked for would have. One that may still fit goes on with a warning and its barrier tasks wait
    for the rest within ``start_timeout``.
    """
    s = "" if executors == 1 else "s"
    asked = f" of the {target.executors} asked for ({target.source})" if target.executors is not None else ""
    numbers = (
        f"{executors} executor{s} registered{asked} with {slots} task slot{'' if slots == 1 else 's'} in all "
        f"(spark.task.cpus={task_cpus}; master={master})"
    )
    if default_parallelism:
        numbers += f"; spark.default.parallelism={default_parallelism} is not the executors' cores and does not count"
    if waited >= 0.5:
        numbers += f"; waited {waited:.0f}s for them"
    fix = f"give the application {target.fix}, or lower spark.task.cpus"
    if num_proc is None:
        if slots >= 1:
            warning = None
            if not settled:
                warning = f"num_proc defaults to the task slots registered so far ({slots}): {numbers}."
            return SlotVerdict(slots, warning=warning)
        return SlotVerdict(
            0,
            error=(
                f"num_proc cannot default to the application's task slots: it has none yet ({numbers}). "
                f"Pass num_proc, let hvd_spark wait longer for the executors ({wait_setting}), or {fix}."
            ),
        )
    if slots >= num_proc:
        return SlotVerdict(slots)
    lower = f"Lower num_proc to at most {slots}, or {fix}." if slots >= 1 else f"Pass fewer ranks, or {fix}."
    head = f"num_proc must be at most the number of task slots ({slots}) for a barrier stage. "
    head += f"Received: num_proc={num_proc}."
    never = "Spark starts all tasks of a barrier stage at once, so these ranks could never start."
    if settled:
        return SlotVerdict(slots, error=f"{head} The application has {numbers}. {never} {lower}")
    each = target.slots_each
    if executors >= 1:
        each = -(-slots // executors)  # what the registered ones have (GPUs and standalone's whole Workers count)
    bound = target.executors * each if target.executors is not None and each is not None else None
    if bound is not None and num_proc > bound:
        return SlotVerdict(
            slots,
            error=(
                f"num_proc must be at most the number of task slots ({bound}) the application can have for a "
                f"barrier stage. Received: num_proc={num_proc}. It asked for {target.executors} executors "
                f"({target.source}) of {each} task slot{'' if each == 1 else 's'} each, and has {numbers}. "
                f"{never} Lower num_proc to at most {bound}, or {fix}."
            ),
        )
    return SlotVerdict(
        max(num_proc, bound or 0),
        warning=(
            f"{num_proc} ranks need {num_proc} task slots and the application has {numbers}; the barrier "
            "tasks wait for more executors to register (start_timeout)."
        ),
    )


GPU_CONF_HELP = (
    "spark.task.resource.gpu.amount (GPUs per barrier task, e.g. 1), spark.executor.resource.gpu.amount "
    "(GPUs per executor) and, on standalone and local-cluster masters, spark.worker.resource.gpu.amount "
    "with spark.worker.resource.gpu.discoveryScript (YARN and Kubernetes discover them: see docs/gpu.md)"
)


def task_gpu_amount(conf) -> float:
    """GPUs per Spark task (``spark.task.resource.gpu.amount``, default 0) from anything with ``get``."""
    raw = conf.get("spark.task.resource.gpu.amount", "0") or "0"
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"spark.task.resource.gpu.amount must be a number. Received: {raw!r}.") from None


def gpu_env(addresses: list[str] | None, use_gpu: bool, user_env: dict[str, str]) -> dict[str, str]:
    """The environment that gives a rank exactly its task's GPUs.

    Args:
        addresses: the GPU addresses Spark assigned to the rank's task (``TaskContext.resources()``),
            or None when it assigned none.
        use_gpu: whether the job trains on GPUs.
        user_env: the job's ``env``: a ``CUDA_VISIBLE_DEVICES`` or ``TF_FORCE_GPU_ALLOW_GROWTH`` set
            there wins.

    Raises:
        ValueError: ``use_gpu`` and no GPU assigned, naming the Spark conf keys.
    """
    if not use_gpu:
        # A CPU job on GPU tasks: TensorFlow must not take the GPUs (they may be other tasks' too).
        return {"CUDA_VISIBLE_DEVICES": ""} if addresses and "CUDA_VISIBLE_DEVICES" not in user_env else {}
    if not addresses:
        raise ValueError(
            "use_gpu=True, but Spark assigned no GPU to this barrier task. Schedule GPUs to the tasks with "
            f"{GPU_CONF_HELP}; or pass use_gpu=False to train on CPUs."
        )
    env = {"HVD_SPARK_GPUS": ",".join(addresses), "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(addresses)
    for name in ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH"):
        if name in user_env:
            env[name] = user_env[name]
    return env


def gpu_operations(nccl_built: bool, env: dict[str, str]) -> dict[str, str]:
    """Horovod's GPU collectives for a rank that has GPUs (``HVD_SPARK_GPUS``): NCCL when Horovod was
    built with it, unless the job's environment already chooses (``HOROVOD_GPU_OPERATIONS``, or the
    per-operation ``HOROVOD_GPU_ALLREDUCE`` etc.). Without NCCL Horovod copies GPU tensors to the host
    and reduces them with Gloo or MPI."""
    if not env.get("HVD_SPARK_GPUS") or not nccl_built:
        return {}
    chosen = ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER", "HOROVOD_GPU_BROADCAST")
    if any(env.get(name) for name in chosen):
        return {}
    return {"HOROVOD_GPU_OPERATIONS": "NCCL"}


@dataclass(frozen=True)
class RankLayout:
    """How many ranks a launch runs and the cores each one computes on (:func:`plan_layout`)."""

    num_proc: int
    threads: int  # TensorFlow intra-/inter-op (and OpenMP) threads of each rank
    task_cpus: int | None  # CPUs each barrier task asks for through a TaskResourceProfile; None: spark.task.cpus
    why: str  # one line for the log: how the layout was chosen


def stage_profiles_supported(master: str, spark_version: str, conf) -> bool:
    """Whether Spark gives a barrier stage its own task CPUs (a ``TaskResourceProfile``): standalone
    and ``local-cluster`` from Spark 3.4, YARN and Kubernetes from 3.5, dynamic allocation off
    (Spark's ``ResourceProfileManager.isSupported``). Not on ``local`` masters, where a task's CPUs
    are not counted at all (one JVM: a rank simply uses more threads)."""
    m = master.strip()
    try:
        major, minor = (int(x) for x in spark_version.split(".")[:2])
    except ValueError:
        return False
    if str(conf.get("spark.dynamicAllocation.enabled", "false") or "false").strip().lower() == "true":
        return False
    if m.startswith("spark://") or m.startswith("local-cluster"):
        return (major, minor) >= (3, 4)
    if m == "yarn" or m.startswith("k8s://"):
        return (major, minor) >= (3, 5)
    return False


def plan_layout(
    layout: str,
    *,
    master: str,
    num_proc: int | None,
    slots: int,
    executors: int | None,
    task_cpus: int,
    profiles: bool,
    use_gpu: bool = False,
) -> RankLayout:
    """The ranks of a launch and their threads.

    ``slot``: one rank per task slot unless ``num_proc`` says otherwise, ``spark.task.cpus`` threads
    each (horovod.spark's layout). ``host``: a host's cores train one rank (or the few ``num_proc``
    puts there), with threads on all of them, so that ranks only allreduce between hosts:

    * a ``local`` master: one rank by default; ``num_proc`` ranks share its cores;
    * a cluster master whose executors are known and where Spark has stage-level scheduling
      (``profiles``): one rank per executor by default, and each barrier task asks for its share of
      the executor's cores (``task_cpus``) without changing the application's ``spark.task.cpus``;
    * anywhere else (Spark Connect on a cluster, a Spark without stage-level scheduling, GPUs, whose
      ranks follow the GPUs Spark gives each task): one rank per slot, as ``slot``.

    ``slots`` are the application's task slots (its cores / ``spark.task.cpus``)."""
    cpus = max(1, int(task_cpus))
    if layout == "slot" or use_gpu:
        n = num_proc or slots
        why = "one rank per task slot" + (" (GPUs: a rank per task)" if use_gpu and layout != "slot" else "")
        return RankLayout(n, cpus, None, f"{why}, {cpus} thread(s) each")
    if is_local_master(master):
        cores = slots * cpus
        n = num_proc or 1
        threads = max(cpus, cores // n)
        return RankLayout(n, threads, None, f"{n} rank(s) on the {cores} cores of {master}, {threads} thread(s) each")
    if executors and profiles and slots >= executors:
        cores_each = (
            slots // executors
        ) * cpus  # executors of one size assumed (Spark's own barrier count is per executor)
        n = num_proc or executors
        per_executor = -(-n // executors)
        share = cores_each // per_executor
        if share > cpus:
            return RankLayout(
                n,
                share,
                share,
                f"{n} rank(s) on {executors} executor(s) of {cores_each} cores, {share} cores each "
                "(a TaskResourceProfile for the barrier stage)",
            )
    n = num_proc or slots
    hint = f"one rank per task slot ({n}), {cpus} thread(s) each" + (
        ""
        if profiles
        else "; to give a rank all of an executor's cores here, set spark.task.cpus to spark.executor.cores"
    )
    return RankLayout(n, cpus, None, hint)
