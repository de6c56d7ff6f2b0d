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

    Local masters are read from the master URL; other cluster managers report their total
    cores as ``defaultParallelism`` (unless ``spark.default.parallelism`` overrides it).

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
