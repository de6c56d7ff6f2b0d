"""What each Spark barrier task does: rendezvous, start its rank's process, watch it, report.

This runs inside Spark's Python worker. The barrier closure shipped by the launcher calls
:func:`run_task` with plain values only (no SparkSession, no ``self``).
"""

import collections
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

from hvd_spark._internal import netcheck, settings
from hvd_spark._internal.driver_service import KIND, Kind, TaskClient
from hvd_spark._internal.outcomes import ABORTED, ERROR, OK, PROCESS_DIED, RankOutcome, TaskSpec
from hvd_spark._internal.topology import RankInfo, assign_ranks, horovod_env, threads_env

TAIL_LINES = 40


def iface_for_ip(ip: str) -> str:
    """The name of the network interface that holds ``ip`` ('lo' for loopback addresses)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    if ip.startswith("127."):
        return "lo"
    raise RuntimeError(f"No network interface holds {ip}, the address this task uses to reach the driver.")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the task's process dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return  # not Linux: the task's own kill on exit still applies


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return str(-rc)


def _kill_tree(proc: subprocess.Popen, grace: float) -> None:
    """Stops a rank process and everything it started (its own process group)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _plan(ranks: list[RankInfo]):
    """Horovod's SlotInfo list for its rendezvous server, in rank order."""
    from horovod.runner.common.util.hosts import SlotInfo

    return [
        SlotInfo(
            hostname=r.host,
            rank=r.rank,
            local_rank=r.local_rank,
            cross_rank=r.cross_rank,
            size=r.size,
            local_size=r.local_size,
            cross_size=r.cross_size,
        )
        for r in sorted(ranks, key=lambda r: r.rank)
    ]


class _Watch:
    """Forwards a process's output to the driver, keeps its last lines, and listens for aborts."""

    def __init__(self, client: TaskClient, default_rank: int, parse_tag: bool = False, silence_limit: float = 30.0):
        self.client = client
        self.default_rank = default_rank
        self.parse_tag = parse_tag
        self.tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.abort = threading.Event()
        self.all_done = threading.Event()
        self.abort_reason = ""
        self.dump_stacks = False
        self.silence_limit = silence_limit
        self.last_heard = time.monotonic()
        threading.Thread(target=self._listen, daemon=True, name="hvd_spark-task-listen").start()
        threading.Thread(target=self._watchdog, daemon=True, name="hvd_spark-task-watchdog").start()

    def _watchdog(self) -> None:
        """Stops the rank when the driver has said nothing (it beats every few seconds) for too long:
        this host was cut off, and nobody would ever tell the rank to stop."""
        while not (self.abort.is_set() or self.all_done.is_set()):
            quiet = time.monotonic() - self.last_heard
            if quiet > self.silence_limit:
                self.abort_reason = f"no word from the driver for {quiet:.0f} s (this host was cut off)"
                self.abort.set()
                return
            self.abort.wait(1.0)

    def _listen(self) -> None:
        for msg in self.client.messages():
            self.last_heard = time.monotonic()
            if msg.get(KIND) == Kind.ABORT:
                self.abort_reason = msg.get("reason", "")
                self.dump_stacks = bool(msg.get("dump"))
                self.abort.set()
            elif msg.get(KIND) == Kind.ALL_DONE:
                self.all_done.set()
        # The driver went away: nobody is waiting for this job any more.
        self.abort_reason = self.abort_reason or "the driver closed the connection"
        self.abort.set()

    def pump(self, stream) -> threading.Thread:
        def run():
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                rank = self.default_rank
                if self.parse_tag and line.startswith("[1,"):
                    # mpirun --tag-output: "[1,<rank>]<stdout>:text"
                    head, _, rest = line.partition("]")
                    try:
                        rank = int(head[3:])
                        line = rest.split(">:", 1)[-1]
                    except ValueError:
                        rank = self.default_rank  # not mpirun's tag after all: keep the line whole
                self.tails[rank].append(line)
                self.client.send({KIND: Kind.LOG, "rank": rank, "line": line})

        t = threading.Thread(target=run, daemon=True, name="hvd_spark-task-output")
        t.start()
        return t


def _outcome(workdir: str, rank: int, rc: int | None, aborted: bool, tail) -> RankOutcome:
    """Reads what a rank left in ``workdir``: its result, its error, or how its process ended."""
    result = os.path.join(workdir, f"result-{rank}.pkl")
    error = os.path.join(workdir, f"error-{rank}.pkl")
    if os.path.exists(result):
        with open(result, "rb") as f:
            return RankOutcome(rank, OK, result=f.read())
    if os.path.exists(error):
        with open(error, "rb") as f:
            return cloudpickle.load(f)
    if aborted:
        return RankOutcome(rank, ABORTED, tail=tuple(tail or ()))
    if rc is not None and rc < 0:
        how = f"process killed by signal {-rc} ({_signal_name(rc)})"
    else:
        how = f"process exited with code {rc} before reporting a result"
    return RankOutcome(
        rank,
        ERROR,
        type=PROCESS_DIED,
        message=how,
        traceback="Last output lines:\n" + "\n".join(tail or []),
        time=time.time(),
    )


def _report(client: TaskClient, outcome: RankOutcome) -> None:
    if outcome.status == ERROR:
        client.send({KIND: Kind.FAIL, **outcome.to_message()})
    client.send({KIND: Kind.DONE, "rank": outcome.rank, "ok": outcome.status == OK})


def _check_hosts(
    client: TaskClient, me: RankInfo, ranks: list[RankInfo], infos: list[dict], partition: int
) -> RankOutcome | None:
    """Every task sees every host's answer (from the allGather), so all of them stop together when
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
        return RankOutcome(me.rank, ABORTED)
    outcome = RankOutcome(me.rank, ERROR, type="HostConfigurationError", message=problems[me.rank], time=time.time())
    _report(client, outcome)
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
    workdir = tempfile.mkdtemp(prefix="hvd_spark-")
    try:
        ip = client.local_ip
        hostname = socket.gethostname()
        mine = {"host": ip, "iface": iface_for_ip(ip), "hostname": hostname}
        if spec.backend == "gloo":
            mine["bind"] = netcheck.hostname_bind_address(hostname) or ""
        infos = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
        ranks = assign_ranks([i["host"] for i in infos])
        me = ranks[partition]
        client.send({KIND: Kind.RANK, "rank": me.rank})
        if spec.backend == "gloo":
            refused = _check_hosts(client, me, ranks, infos, partition)
            if refused is not None:
                return [cloudpickle.dumps(refused)]
        if spec.backend == "mpi":
            return _run_mpi(spec, ctx, client, me, ranks, workdir)

        if me.rank == 0:
            from horovod.runner.http.http_server import RendezvousServer

            # The server keeps its socket bound from start(): no bind-then-close race.
            server = RendezvousServer()
            port = server.start()
            server.init(_plan(ranks))
            published = json.dumps({"addr": ip, "port": port})
        else:
            published = ""
        rendezvous = next(json.loads(m) for m in ctx.allGather(published) if m)

        env = dict(os.environ)
        env.update(
            horovod_env(
                me,
                rendezvous_addr=rendezvous["addr"],
                rendezvous_port=rendezvous["port"],
                iface=infos[partition]["iface"],
                gloo_timeout=spec.gloo_timeout,
                num_threads=spec.num_threads,
            )
        )
        env.update(spec.env)  # the caller's settings win over the defaults above
        env.update(
            {
                settings.ENV_RANK: str(me.rank),
                settings.ENV_DRIVER_ADDR: spec.driver_addr,
                settings.ENV_JOB_TOKEN: spec.token,
                "PYTHONUNBUFFERED": "1",
            }
        )
        outcome, watch = _run_child(spec, client, me.rank, env, workdir)
        _report(client, outcome)
        if server is not None:
            # Rank 0's task serves the rendezvous until every rank is done (or the job is aborted).
            _wait_for_end(watch)
        return [cloudpickle.dumps(outcome)]
    finally:
        beating.set()
        if server is not None:
            server.stop()
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _beat(client: TaskClient, stop: threading.Event) -> None:
    """Tells the driver every few seconds that this task (and its host) is alive."""
    while not stop.wait(settings.HEARTBEAT_INTERVAL):
        if not client.send({KIND: Kind.BEAT}):
            return


def _wait_for_end(watch: _Watch) -> None:
    """Blocks until the driver says every rank is done, or aborts the job (or goes away)."""
    while not (watch.all_done.is_set() or watch.abort.is_set()):
        watch.all_done.wait(0.2)


def _write_payload(spec: TaskSpec, workdir: str) -> None:
    with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
        f.write(spec.payload)


def _supervise(proc: subprocess.Popen, watch: _Watch, grace: float) -> bool:
    """Waits for ``proc``; on an abort, stops it. Returns True when it was aborted."""
    while proc.poll() is None:
        if watch.abort.wait(0.2):
            if proc.poll() is not None:
                # It ended on its own (often the very failure that caused the abort): report that.
                return False
            if watch.dump_stacks:
                # Have the rank print its Python stack (faulthandler) so the driver can say where it was.
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    time.sleep(1.5)
                except ProcessLookupError:
                    return True  # it is already gone
            _kill_tree(proc, grace)
            return True
    return False


def _run_watched(cmd: list[str], env: dict, workdir: str, watch: _Watch, grace: float):
    """Starts ``cmd`` in its own process group (killed if this task dies), forwards its output and
    waits for it, stopping it on an abort. Returns (exit code, whether it was aborted)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        cwd=workdir,
    )
    pump = watch.pump(proc.stdout)
    try:
        aborted = _supervise(proc, watch, grace)
    finally:
        _kill_tree(proc, 1.0)
    pump.join(5)
    return proc.returncode, aborted


def _run_child(spec: TaskSpec, client: TaskClient, rank: int, env: dict, workdir: str) -> tuple[RankOutcome, "_Watch"]:
    _write_payload(spec, workdir)
    watch = _Watch(client, rank, silence_limit=spec.heartbeat_timeout)
    rc, aborted = _run_watched(
        [sys.executable, "-m", "hvd_spark._internal.child", workdir], env, workdir, watch, spec.abort_grace
    )
    return _outcome(workdir, rank, rc, aborted, list(watch.tails[rank])), watch


def _run_mpi(spec: TaskSpec, ctx, client: TaskClient, me: RankInfo, ranks: list[RankInfo], workdir: str) -> list[bytes]:
    """MPI controller: rank 0's task runs ``mpirun`` for the whole job; the others wait with it."""
    hosts = {r.host for r in ranks}
    if len(hosts) > 1:
        raise NotImplementedError(
            "use_mpi=True with barrier tasks on several hosts is not supported yet: mpirun would need an "
            "rsh agent that starts its daemons through the Spark tasks. Use the Gloo controller "
            f"(use_gloo=True) for multi-host jobs. Hosts: {sorted(hosts)}"
        )
    watch = _Watch(client, me.rank, parse_tag=True, silence_limit=spec.heartbeat_timeout)
    ctx.barrier()
    if me.rank != 0:
        # The ranks all run under rank 0's mpirun on this host; this task holds its slot.
        _wait_for_end(watch)
        return []
    _write_payload(spec, workdir)
    env = dict(os.environ)
    env.update(threads_env(spec.num_threads))
    env.update(spec.env)
    env.update(
        {
            settings.ENV_DRIVER_ADDR: spec.driver_addr,
            settings.ENV_JOB_TOKEN: spec.token,
            "PYTHONUNBUFFERED": "1",
            "HOROVOD_CONTROLLER": "mpi",
            "HOROVOD_CPU_OPERATIONS": "mpi",
        }
    )
    for name in ("HVD_SPARK_RANK", "HOROVOD_RANK", "HOROVOD_SIZE"):
        env.pop(name, None)
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    cmd = [
        "mpirun",
        "-np",
        str(me.size),
        "--oversubscribe",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--tag-output",
        sys.executable,
        "-m",
        "hvd_spark._internal.child",
        workdir,
    ]
    rc, aborted = _run_watched(cmd, env, workdir, watch, spec.abort_grace)
    outcomes = [_outcome(workdir, r, rc, aborted, list(watch.tails[r])) for r in range(me.size)]
    if any(o.status == ERROR and o.type != PROCESS_DIED for o in outcomes):
        # mpirun stops the other ranks once one fails; those are not failures of their own.
        outcomes = [o.as_aborted() if o.status == ERROR and o.type == PROCESS_DIED else o for o in outcomes]
    for o in outcomes:
        _report(client, o)
    _wait_for_end(watch)
    return [cloudpickle.dumps(o) for o in outcomes]
