"""The MPI controller of a job: rank 0's task runs ``mpirun`` for all ranks; on other hosts the
first task serves Open MPI's rsh agent (:mod:`.mpi_agent`) that starts the host's ``orted``.

Runs inside Spark barrier tasks, like :mod:`.barrier`, whose watch and reporting (:mod:`.watch`) it shares.
"""

import json
import os
import secrets
import sys

import cloudpickle

from hvd_spark._internal.common import logs, settings
from hvd_spark._internal.common.outcomes import ERROR, PROCESS_DIED, TaskSpec
from hvd_spark._internal.common.service import TaskClient
from hvd_spark._internal.common.topology import RankInfo, threads_env
from hvd_spark._internal.task import mpi_agent, netcheck
from hvd_spark._internal.task.watch import (
    ENV_WORKDIR,
    Watch,
    read_outcome,
    report,
    run_watched,
    wait_for_end,
    write_payload,
)


def _mpi_env(spec: TaskSpec, workdir: str, host: str) -> dict[str, str]:
    """The environment of mpirun on rank 0's host and of ``orted`` on the others (their ranks inherit it)."""
    env = dict(os.environ)
    env.update(threads_env(spec.num_threads))
    # A rank waiting for its peer yields its core instead of spinning on it: where ranks share a host's
    # cores, the spin took a core from the other rank's compute (a step 0.57x-0.74x as long measured with
    # it, benchmarks/results/comm.json "shared_host"). The job's env can set it back.
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    env.update(spec.env)
    env.update(
        {
            settings.ENV_DRIVER_ADDR: spec.driver_addr,
            settings.ENV_JOB_TOKEN: spec.token,
            ENV_WORKDIR: workdir,
            settings.ENV_HOST: host,
            "PYTHONUNBUFFERED": "1",
            "HOROVOD_CONTROLLER": "mpi",
            "HOROVOD_CPU_OPERATIONS": "mpi",
        }
    )
    for name in ("HVD_SPARK_RANK", "HOROVOD_RANK", "HOROVOD_SIZE"):
        env.pop(name, None)
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env


def _network_of(ip: str) -> str:
    """The subnet (CIDR) of the interface that holds ``ip``: where mpirun's daemons and ranks talk."""
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.address == ip and a.netmask:
                return str(ipaddress.ip_interface(f"{ip}/{a.netmask}").network)
    return f"{ip}/32"


# What rank 0's task passes every rank through mpirun (``-x``): torch.distributed's rendezvous and the
# ranks per host, from which each rank's entry sets the rest (topology.mpi_torch_env).
TORCH_EXPORTS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", settings.ENV_NODE_SIZES)


def torch_exports(ranks: list[RankInfo], master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """The values of :data:`TORCH_EXPORTS` for a job laid out as ``ranks``."""
    sizes: dict[str, int] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        sizes[r.host] = sizes.get(r.host, 0) + 1
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(int(master_port)),
        "TORCHELASTIC_RUN_ID": run_id,
        settings.ENV_NODE_SIZES: ",".join(str(n) for n in sizes.values()),
    }


def mpirun_command(
    ranks: list[RankInfo], env: dict[str, str], network: str | None, exports: tuple[str, ...] = ()
) -> list[str]:
    """mpirun for the whole job: one slot per barrier task, ranks laid out as :func:`assign_ranks` did
    (contiguous per host, hosts in rank order). ``network`` (a CIDR) is set for jobs on several hosts:
    remote daemons are then started through hvd_spark's rsh agent and talk over that subnet.
    ``exports``: variables of ``env`` every rank gets (``-x``), remote ones included."""
    slots: dict[str, int] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        slots[r.host] = slots.get(r.host, 0) + 1
    cmd = ["mpirun", "-np", str(len(ranks))]
    if network is not None:
        cmd += ["-H", ",".join(f"{h}:{n}" for h, n in slots.items()), "--leave-session-attached"]
        cmd += ["--mca", "plm_rsh_agent", mpi_agent.agent_command(), "--mca", "plm_rsh_no_tree_spawn", "1"]
        for param in ("oob_tcp_if_include", "btl_tcp_if_include"):
            kind = param.rsplit("_", 1)[0]
            if not any(f"OMPI_MCA_{kind}_{x}" in env for x in ("include", "exclude")):
                cmd += ["--mca", param, network]  # the user's own interface choice wins
    cmd += ["--oversubscribe", "--bind-to", "none", "--map-by", "slot", "--tag-output"]
    for name in exports:
        cmd += ["-x", name]
    return cmd + [sys.executable, "-m", "hvd_spark._internal.rank.entry"]


def _host_outcomes(workdir: str, ranks: list[RankInfo], host: str, rc: int | None, aborted: bool, watch: "Watch"):
    """The outcomes of the ranks that ran on ``host`` (their result files are in this host's ``workdir``)."""
    outcomes = [read_outcome(workdir, r.rank, rc, aborted, list(watch.tails[r.rank])) for r in ranks if r.host == host]
    if any(o.status == ERROR and o.type != PROCESS_DIED for o in outcomes):
        # mpirun stops the other ranks once one fails; those are not failures of their own.
        outcomes = [o.as_aborted() if o.status == ERROR and o.type == PROCESS_DIED else o for o in outcomes]
    return outcomes


def run_mpi(spec: TaskSpec, client: TaskClient, me: RankInfo, ranks: list[RankInfo], workdir: str) -> list[bytes]:
    """MPI controller: rank 0's task runs ``mpirun`` for the whole job. On every other host, the first
    task serves the rsh agent (it runs that host's ``orted``, whose ranks write their results in its
    ``workdir``) and reports that host's ranks; the other tasks hold their slots until the job ends."""
    by_rank = sorted(ranks, key=lambda r: r.rank)
    first_host = by_rank[0].host
    several_hosts = len({r.host for r in ranks}) > 1
    env = _mpi_env(spec, workdir, me.host)
    server = None
    # Rank 0's TCPStore port (torch.distributed), held from here on as a Gloo job's (netcheck.ReservedPort).
    reserved = netcheck.ReservedPort(me.host) if me.rank == 0 else None
    if several_hosts and me.local_rank == 0 and me.host != first_host:
        write_payload(spec, workdir)
        server = mpi_agent.CommandServer(me.host, spec.token, env, workdir)
        published = json.dumps({"host": me.host, "addr": server.addr})
    else:
        published = ""
    try:
        gathered = client.gather("mpi-agents", published, spec.heartbeat_timeout)
        servers = {d["host"]: d["addr"] for d in (json.loads(m) for m in gathered if m)}
        # After the exchange: the watch reads the driver's messages from here on.
        watch = Watch(
            client,
            me.rank,
            parse_tag=me.rank == 0,
            silence_limit=spec.heartbeat_timeout,
            quiet_tf=logs.tf_quiet(spec.env),
        )
        if me.rank == 0:
            write_payload(spec, workdir)
            env[mpi_agent.ENV_HOSTS] = json.dumps(servers)
            assert reserved is not None
            env.update(torch_exports(ranks, me.host, reserved.port, f"hvd_spark-{secrets.token_hex(8)}"))
            if not reserved.HELD_FOR_TORCH:
                reserved.release()
            network = _network_of(me.host) if several_hosts else None
            cmd = mpirun_command(ranks, env, network, TORCH_EXPORTS)
            rc, aborted = run_watched(cmd, env, workdir, watch, spec.abort_grace)
        elif server is not None:
            # This host's ranks are done when its orted ends; an abort stops it.
            while not (server.finished.is_set() or watch.abort.is_set()):
                server.finished.wait(0.2)
            aborted = not server.finished.is_set()
            server.stop(spec.abort_grace)
            rc = server.returncode
        else:
            wait_for_end(watch)
            return []
        outcomes = _host_outcomes(workdir, ranks, me.host, rc, aborted, watch)
        for o in outcomes:
            report(client, o)
        wait_for_end(watch)
        return [cloudpickle.dumps(o) for o in outcomes]
    finally:
        if server is not None:
            server.stop(1.0)
        if reserved is not None:
            reserved.release()
