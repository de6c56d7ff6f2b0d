"""What each Spark barrier task does: rendezvous, start its rank's process, watch it, report.

This runs inside Spark's Python worker. The barrier closure shipped by the launcher calls
:func:`run_task` with plain values only (no SparkSession, no ``self``). On Spark Connect the first
task also runs the job's coordinator (``driver/coordinator.py``), and every task reaches it as it
would reach the driver.
"""

import os
import secrets
import socket
import sys
import tempfile
import threading
import time

import cloudpickle

from hvd_spark._internal.common import logs, settings
from hvd_spark._internal.common.forks import Payload
from hvd_spark._internal.common.outcomes import ABORTED, ERROR, RankOutcome, TaskSpec
from hvd_spark._internal.common.service import KIND, Kind, TaskClient
from hvd_spark._internal.common.topology import (
    RankInfo,
    assign_ranks,
    gpu_env,
    horovod_env,
    node_of,
    threads_env,
    torch_env,
)
from hvd_spark._internal.task import netcheck, warm
from hvd_spark._internal.task.procs import FolderJanitor
from hvd_spark._internal.task.watch import Watch, read_outcome, report, run_watched, wait_for_end, write_payload

# A rank's process: started fresh (``python -m``), or forked by the host's warm server (``task/warm.py``).
RANK_MODULE = "hvd_spark._internal.rank.entry"
RANK = Payload("rank", f"{RANK_MODULE}:forked")
RANK_NAME = RANK.process_name  # a forked rank's process name (/proc/<pid>/comm)


def iface_for_ip(ip: str) -> str:
    """The name of the network interface that holds ``ip`` ('lo' for loopback addresses)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    if ip.startswith("127."):
        return "lo"
    raise RuntimeError(f"No network interface holds {ip}, the address this task uses to reach the driver.")


def _plan(ranks: list[RankInfo]):
    """Horovod's SlotInfo list for its rendezvous server, in rank order."""
    from hvd_spark._internal.common import internals

    return internals.rendezvous_slots(ranks)


def _check_hosts(
    client: TaskClient, me: RankInfo, ranks: list[RankInfo], infos: list[dict], partition: int
) -> RankOutcome | None:
    """Every task sees every host's answer (from the exchange of host infos), so all of them stop together when
    one host cannot be reached: that task reports the error, the others end as aborted."""
    version = netcheck.horovod_version()
    hosts = [i["host"] for i in infos]
    problems = {
        ranks[t].rank: problem
        for t, i in enumerate(infos)
        if (
            problem := netcheck.gloo_host_problem(
                rank=ranks[t].rank,
                ip=i["host"],
                hosts=hosts,
                version=version,
                hostname=i["hostname"],
                bind_address=i.get("bind"),
            )
        )
    }
    if not problems:
        return None
    if me.rank not in problems:
        outcome = RankOutcome(me.rank, ABORTED)
        report(client, outcome)  # done (not ok): its connection closing is no lost task
        return outcome
    outcome = RankOutcome(me.rank, ERROR, type="HostConfigurationError", message=problems[me.rank], time=time.time())
    report(client, outcome)
    return outcome


def run_task(spec: TaskSpec) -> list[bytes]:
    """The body of one barrier task. Returns the pickled outcome records this task knows of."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    client = TaskClient(spec.driver_addr, spec.token, {"role": "task", "partition": partition})
    beating = threading.Event()
    threading.Thread(target=_beat, args=(client, beating), daemon=True, name="hvd_spark-task-beat").start()
    server = None
    reserved = None
    workdir = tempfile.mkdtemp(prefix="hvd_spark-")
    janitor = FolderJanitor(workdir)  # the rank's folder goes however the task ends, killed included
    try:
        ip = client.local_ip
        hostname = socket.gethostname()
        mine: dict[str, str | int] = {"host": ip, "iface": iface_for_ip(ip), "hostname": hostname}
        if spec.backend == "gloo":
            mine["bind"] = netcheck.hostname_bind_address(hostname) or ""
            # Every task serves a rendezvous before the one exchange (a second round would cost a
            # round trip); the task that gets rank 0 keeps its server, the others stop theirs.
            server = _Rendezvous(ip)
            mine["rendezvous_port"] = server.port
            # torch.distributed's too (MASTER_PORT): rank 0's task keeps its port, the others free theirs.
            reserved = netcheck.ReservedPort(ip)
            mine["torch_port"] = reserved.port
            mine["torch_run"] = secrets.token_hex(8)
        # Through the driver service, not Spark's allGather (about a second a round).
        infos = client.gather("hosts", mine, spec.heartbeat_timeout)
        ranks = assign_ranks([i["host"] for i in infos])
        me = ranks[partition]
        client.send({KIND: Kind.RANK, "rank": me.rank})
        if spec.backend == "gloo":
            refused = _check_hosts(client, me, ranks, infos, partition)
            if refused is not None:
                return [cloudpickle.dumps(refused)]
        if spec.backend == "mpi":
            from hvd_spark._internal.task.mpi import run_mpi

            return run_mpi(spec, client, me, ranks, workdir)

        first = infos[next(t for t, r in enumerate(ranks) if r.rank == 0)]
        assert server is not None and reserved is not None  # a Gloo job: started above
        if me.rank == 0:
            server.plan(_plan(ranks))
        else:
            server.stop()
            server = None
            reserved.release()
        env = _collective_env(spec, me, ranks, first, infos[partition]["iface"])
        try:
            env.update(gpu_env(_task_gpus(ctx), spec.use_gpu, spec.env))
        except ValueError as e:  # GPUs asked for, none assigned: this rank's failure, named
            refused = RankOutcome(me.rank, ERROR, type="GpuNotAssigned", message=str(e), time=time.time())
            report(client, refused)
            return [cloudpickle.dumps(refused)]
        env.update(base_env(spec.env, spec.num_threads))
        env.update(
            {
                settings.ENV_RANK: str(me.rank),
                settings.ENV_HOST: me.host,
                settings.ENV_DRIVER_ADDR: spec.driver_addr,
                settings.ENV_JOB_TOKEN: spec.token,
            }
        )
        if not netcheck.ReservedPort.HELD_FOR_TORCH:
            reserved.release()  # TCPStore could not bind a held port here: the window of docs/launcher.md
        return _run_rank(spec, client, me.rank, env, workdir, server)
    finally:
        beating.set()
        if server is not None:
            server.stop()
        if reserved is not None:
            reserved.release()
        client.close()
        janitor.close()


def _collective_env(spec: TaskSpec, me: RankInfo, ranks: list[RankInfo], first: dict, iface: str) -> dict:
    """The task's environment with Horovod's Gloo variables (rank 0's task serves the rendezvous) and
    torch.distributed's (:func:`_torch_env`)."""
    env = dict(os.environ)
    env.update(
        horovod_env(
            me,
            rendezvous_addr=first["host"],
            rendezvous_port=first["rendezvous_port"],
            iface=iface,
            gloo_timeout=spec.gloo_timeout,
            num_threads=spec.num_threads,
        )
    )
    env.update(_torch_env(me, ranks, first, iface))
    return env


def _torch_env(me: RankInfo, ranks: list[RankInfo], first: dict, iface: str) -> dict[str, str]:
    """torch.distributed's variables for this rank: rank 0's task's address and reserved port are the
    job's MASTER_ADDR / MASTER_PORT, its random id the job's TORCHELASTIC_RUN_ID."""
    node, nodes = node_of(me, ranks)
    return torch_env(
        me,
        node=node,
        nodes=nodes,
        master_addr=first["host"],
        master_port=first["torch_port"],
        run_id=f"hvd_spark-{first['torch_run']}",
        iface=iface,
    )


def _run_rank(
    spec: TaskSpec, client: TaskClient, rank: int, env: dict, workdir: str, server: "_Rendezvous | None"
) -> list[bytes]:
    """Starts the rank's process with ``env`` and watches it to its end; reports and returns its
    outcome. ``server``: the rendezvous rank 0's task serves (None in the other tasks)."""
    # Rank 0's task closes the rendezvous once every rank's hvd.init() returned; Horovod's dynamic
    # process sets (hvd.add_process_set after init) rendezvous again, so it stays open for them.
    dynamic = env.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() not in ("", "0", "false")
    close = server.stop if server is not None and not dynamic else None
    outcome, watch = _run_child(spec, client, rank, env, workdir, on_ranks_initialized=close)
    report(client, outcome)
    if server is not None:
        # Rank 0's task serves the rendezvous until every rank is done (or the job is aborted).
        wait_for_end(watch)
    return [cloudpickle.dumps(outcome)]


def _task_gpus(ctx) -> list[str] | None:
    """The GPU addresses Spark assigned to this task, or None."""
    try:
        info = ctx.resources().get("gpu")
    except Exception:  # a Spark without task resources
        return None
    return list(info.addresses) if info is not None and info.addresses else None


def base_env(extra: dict[str, str], num_threads: int) -> dict[str, str]:
    """What a rank's environment adds to its task's, apart from Horovod's per-job variables and the
    rank's identity: the thread caps, then the caller's settings (they win), unbuffered output. A
    warm server is keyed by the task's environment with this on top (see :func:`prewarm`)."""
    env = threads_env(num_threads)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def prewarm(extra: dict[str, str], num_threads: int, app: str) -> str:
    """Starts this host's warm server for the ranks a later job will start here (without waiting)."""
    env = dict(os.environ)
    env.update(base_env(extra, num_threads))
    return warm.ensure_server(env, app)


class _Rendezvous:
    """Horovod's Gloo rendezvous (an HTTP key-value store, without authentication) for one job,
    serving from creation on the task's own address (not every interface), until :meth:`stop`:
    rank 0's task stops it once every rank's ``hvd.init()`` has returned."""

    def __init__(self, addr: str):
        from hvd_spark._internal.common import internals

        self._httpd = internals.rendezvous_server(addr)  # bound from here on: no race
        self.port = self._httpd.server_address[1]
        self._stopped = threading.Event()
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="hvd_spark-rendezvous").start()

    def plan(self, slots) -> None:
        """Declares each scope's size (Horovod clears a scope once all its members have left it).
        Horovod's ``init`` would also empty the store, and a rank may have written to it already:
        its task can learn the rendezvous address before this one."""
        from hvd_spark._internal.common import internals

        internals.declare_rendezvous_scopes(self._httpd, slots)

    def stop(self) -> None:
        """Stops serving and closes the port, without waiting (the server notices within its 0.5 s poll)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        httpd = self._httpd
        threading.Thread(target=lambda: (httpd.shutdown(), httpd.server_close()), daemon=True).start()


def _beat(client: TaskClient, stop: threading.Event) -> None:
    """Tells the driver every few seconds that this task (and its host) is alive."""
    while not stop.wait(settings.HEARTBEAT_INTERVAL):
        if not client.send({KIND: Kind.BEAT}):
            return


def _run_child(
    spec: TaskSpec, client: TaskClient, rank: int, env: dict, workdir: str, on_ranks_initialized=None
) -> tuple[RankOutcome, "Watch"]:
    write_payload(spec, workdir)
    watch = Watch(
        client,
        rank,
        silence_limit=spec.heartbeat_timeout,
        quiet_tf=logs.tf_quiet(spec.env),
        on_ranks_initialized=on_ranks_initialized,
    )
    env[settings.ENV_RANK_STARTED] = repr(time.time())  # the rank's start-up profile counts from here
    # What the driver decided, unless it had nothing to go on: then this executor's own setting counts.
    use_warm = spec.warm and (spec.warm_set or settings.WARM.get(env=os.environ))
    warm_proc = None
    if use_warm:  # a server not ready in time (HVD_SPARK_WARM_START_TIMEOUT): cold, with a warning on the driver
        warm_proc = warm.spawn(RANK, env, workdir, spec.app, spec.start_timeout, args=(workdir,), say=watch.warn)
    rc, aborted = run_watched(
        [sys.executable, "-m", RANK_MODULE, workdir],
        env,
        workdir,
        watch,
        spec.abort_grace,
        warm_proc,
    )
    cause = warm_proc.server_cause() if warm_proc is not None else ""  # its server ended: named
    return read_outcome(workdir, rank, rc, aborted, list(watch.tails[rank]), cause), watch
