"""What each Spark barrier task does: rendezvous, start its rank's process, watch it, report.

This runs inside Spark's Python worker. The barrier closure shipped by the launcher calls
:func:`run_task` with plain values only (no SparkSession, no ``self``).
"""

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

from hvd_spark._internal.common import logs, settings
from hvd_spark._internal.common.outcomes import ABORTED, ERROR, OK, PROCESS_DIED, STATE_PREFIX, RankOutcome, TaskSpec
from hvd_spark._internal.common.topology import RankInfo, assign_ranks, gpu_env, horovod_env, threads_env
from hvd_spark._internal.driver.service import KIND, Kind, TaskClient
from hvd_spark._internal.task import mpi_agent, netcheck, warm
from hvd_spark._internal.task.procs import die_with_parent, kill_tree, signal_name

TAIL_LINES = 40
ENV_WORKDIR = "HVD_SPARK_WORKDIR"  # where an MPI rank finds its payload and leaves its result


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

    def __init__(
        self,
        client: TaskClient,
        default_rank: int,
        parse_tag: bool = False,
        silence_limit: float = 30.0,
        quiet_tf: bool = False,
        on_ranks_initialized=None,
    ):
        self.client = client
        self.on_ranks_initialized = on_ranks_initialized
        self.quiet_tf = quiet_tf
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
            elif msg.get(KIND) == Kind.RANKS_INITIALIZED and self.on_ranks_initialized is not None:
                self.on_ranks_initialized()
        # The driver went away: nobody is waiting for this job any more.
        self.abort_reason = self.abort_reason or "the driver closed the connection"
        self.abort.set()

    def pump(self, stream) -> threading.Thread:
        def run():
            pending: dict[int, str] = collections.defaultdict(str)  # a tagged rank's unfinished line
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace")
                if not self.parse_tag:
                    self._line(self.default_rank, text.rstrip("\n"))
                    continue
                for rank, chunk in split_tagged(text, self.default_rank):
                    pending[rank] += chunk
                    if pending[rank].endswith("\n"):
                        self._line(rank, pending.pop(rank).rstrip("\n"))
            for rank, rest in pending.items():
                if rest:
                    self._line(rank, rest)

        t = threading.Thread(target=run, daemon=True, name="hvd_spark-task-output")
        t.start()
        return t

    def note_state(self, pid: int) -> None:
        """Adds the rank process's state (running, sleeping, stopped, disk-sleep...) to its output,
        where the driver's report of a stall or timeout finds it."""
        import psutil

        try:
            state = psutil.Process(pid).status()
        except psutil.Error:
            return
        self._line(self.default_rank, f"{STATE_PREFIX}{state}")

    def _line(self, rank: int, line: str) -> None:
        self.tails[rank].append(line)
        if not (self.quiet_tf and logs.is_tf_notice(line)):
            self.client.send({KIND: Kind.LOG, "rank": rank, "line": line})


_TAG = re.compile(r"\[1,(\d+)\]<std(?:out|err)>:")


def split_tagged(text: str, default_rank: int) -> list[tuple[int, str]]:
    """Splits a piece of ``mpirun --tag-output`` output into (rank, text) chunks.

    mpirun tags every write of a rank (``[1,<rank>]<stdout>:``), not every line, so one line of a rank
    may arrive in several tagged pieces, between pieces of other ranks; text before any tag belongs to
    ``default_rank`` (mpirun's own messages)."""
    chunks: list[tuple[int, str]] = []
    pos, rank = 0, default_rank
    for m in _TAG.finditer(text):
        if m.start() > pos:
            chunks.append((rank, text[pos : m.start()]))
        rank, pos = int(m.group(1)), m.end()
    if pos < len(text) or not chunks:
        chunks.append((rank, text[pos:]))
    return chunks


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
        how = f"process killed by signal {-rc} ({signal_name(rc)})"
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
            # Every task serves a rendezvous before the one exchange (a second round would cost a
            # round trip); the task that gets rank 0 keeps its server, the others stop theirs.
            server = _Rendezvous(ip)
            mine["rendezvous_port"] = server.port
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
            return _run_mpi(spec, client, me, ranks, workdir)

        first = next(t for t, r in enumerate(ranks) if r.rank == 0)
        rendezvous = {"addr": infos[first]["host"], "port": infos[first]["rendezvous_port"]}
        assert server is not None  # a Gloo job: started above
        if me.rank == 0:
            server.plan(_plan(ranks))
        else:
            server.stop()
            server = None

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
        try:
            env.update(gpu_env(_task_gpus(ctx), spec.use_gpu, spec.env))
        except ValueError as e:  # GPUs asked for, none assigned: this rank's failure, named
            refused = RankOutcome(me.rank, ERROR, type="GpuNotAssigned", message=str(e), time=time.time())
            _report(client, refused)
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
        # Rank 0's task closes the rendezvous once every rank's hvd.init() returned; Horovod's dynamic
        # process sets (hvd.add_process_set after init) rendezvous again, so it stays open for them.
        dynamic = env.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() not in ("", "0", "false")
        close = server.stop if server is not None and not dynamic else None
        outcome, watch = _run_child(spec, client, me.rank, env, workdir, on_ranks_initialized=close)
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
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        self._httpd = RendezvousHTTPServer((addr, 0), RendezvousHandler, 0)  # bound from here on: no race
        self.port = self._httpd.server_address[1]
        self._stopped = threading.Event()
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="hvd_spark-rendezvous").start()

    def plan(self, slots) -> None:
        """Declares each scope's size (Horovod clears a scope once all its members have left it).
        Horovod's ``init`` would also empty the store, and a rank may have written to it already:
        its task can learn the rendezvous address before this one."""
        self._httpd._extract_scope_size(slots)

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
                if not watch.parse_tag:  # proc is the rank itself (not mpirun)
                    watch.note_state(proc.pid)
                # Have the rank print its Python stack (faulthandler) so the driver can say where it was.
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    time.sleep(1.5)
                except ProcessLookupError:
                    return True  # it is already gone
            kill_tree(proc, grace)
            return True
    return False


def _run_watched(cmd: list[str], env: dict, workdir: str, watch: _Watch, grace: float, warm_proc=None):
    """Starts ``cmd`` in its own process group (killed if this task dies), forwards its output and
    waits for it, stopping it on an abort. ``warm_proc``, a rank a warm server forked, replaces the
    fresh process. Returns (exit code, whether it was aborted)."""
    proc = warm_proc or subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,
        cwd=workdir,
    )
    pump = watch.pump(proc.stdout)
    try:
        aborted = _supervise(proc, watch, grace)
    finally:
        kill_tree(proc, 1.0)
    pump.join(5)
    return proc.returncode, aborted


def _run_child(
    spec: TaskSpec, client: TaskClient, rank: int, env: dict, workdir: str, on_ranks_initialized=None
) -> tuple[RankOutcome, "_Watch"]:
    _write_payload(spec, workdir)
    watch = _Watch(
        client,
        rank,
        silence_limit=spec.heartbeat_timeout,
        quiet_tf=logs.tf_quiet(spec.env),
        on_ranks_initialized=on_ranks_initialized,
    )
    env["HVD_SPARK_RANK_STARTED"] = repr(time.time())  # the rank's start-up profile counts from here
    warm_proc = warm.spawn(env, workdir, spec.app, spec.start_timeout) if spec.warm else None
    rc, aborted = _run_watched(
        [sys.executable, "-m", "hvd_spark._internal.rank.entry", workdir],
        env,
        workdir,
        watch,
        spec.abort_grace,
        warm_proc,
    )
    return _outcome(workdir, rank, rc, aborted, list(watch.tails[rank])), watch


def _mpi_env(spec: TaskSpec, workdir: str, host: str) -> dict[str, str]:
    """The environment of mpirun on rank 0's host and of ``orted`` on the others (their ranks inherit it)."""
    env = dict(os.environ)
    env.update(threads_env(spec.num_threads))
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


def mpirun_command(ranks: list[RankInfo], env: dict[str, str], network: str | None) -> list[str]:
    """mpirun for the whole job: one slot per barrier task, ranks laid out as :func:`assign_ranks` did
    (contiguous per host, hosts in rank order). ``network`` (a CIDR) is set for jobs on several hosts:
    remote daemons are then started through hvd_spark's rsh agent and talk over that subnet."""
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
    return cmd + [sys.executable, "-m", "hvd_spark._internal.rank.entry"]


def _host_outcomes(workdir: str, ranks: list[RankInfo], host: str, rc: int | None, aborted: bool, watch: "_Watch"):
    """The outcomes of the ranks that ran on ``host`` (their result files are in this host's ``workdir``)."""
    outcomes = [_outcome(workdir, r.rank, rc, aborted, list(watch.tails[r.rank])) for r in ranks if r.host == host]
    if any(o.status == ERROR and o.type != PROCESS_DIED for o in outcomes):
        # mpirun stops the other ranks once one fails; those are not failures of their own.
        outcomes = [o.as_aborted() if o.status == ERROR and o.type == PROCESS_DIED else o for o in outcomes]
    return outcomes


def _run_mpi(spec: TaskSpec, client: TaskClient, me: RankInfo, ranks: list[RankInfo], workdir: str) -> list[bytes]:
    """MPI controller: rank 0's task runs ``mpirun`` for the whole job. On every other host, the first
    task serves the rsh agent (it runs that host's ``orted``, whose ranks write their results in its
    ``workdir``) and reports that host's ranks; the other tasks hold their slots until the job ends."""
    by_rank = sorted(ranks, key=lambda r: r.rank)
    first_host = by_rank[0].host
    several_hosts = len({r.host for r in ranks}) > 1
    env = _mpi_env(spec, workdir, me.host)
    server = None
    if several_hosts and me.local_rank == 0 and me.host != first_host:
        _write_payload(spec, workdir)
        server = mpi_agent.CommandServer(me.host, spec.token, env, workdir)
        published = json.dumps({"host": me.host, "addr": server.addr})
    else:
        published = ""
    try:
        gathered = client.gather("mpi-agents", published, spec.heartbeat_timeout)
        servers = {d["host"]: d["addr"] for d in (json.loads(m) for m in gathered if m)}
        # After the exchange: the watch reads the driver's messages from here on.
        watch = _Watch(
            client,
            me.rank,
            parse_tag=me.rank == 0,
            silence_limit=spec.heartbeat_timeout,
            quiet_tf=logs.tf_quiet(spec.env),
        )
        if me.rank == 0:
            _write_payload(spec, workdir)
            env[mpi_agent.ENV_HOSTS] = json.dumps(servers)
            cmd = mpirun_command(ranks, env, _network_of(me.host) if several_hosts else None)
            rc, aborted = _run_watched(cmd, env, workdir, watch, spec.abort_grace)
        elif server is not None:
            # This host's ranks are done when its orted ends; an abort stops it.
            while not (server.finished.is_set() or watch.abort.is_set()):
                server.finished.wait(0.2)
            aborted = not server.finished.is_set()
            server.stop(spec.abort_grace)
            rc = server.returncode
        else:
            _wait_for_end(watch)
            return []
        outcomes = _host_outcomes(workdir, ranks, me.host, rc, aborted, watch)
        for o in outcomes:
            _report(client, o)
        _wait_for_end(watch)
        return [cloudpickle.dumps(o) for o in outcomes]
    finally:
        if server is not None:
            server.stop(1.0)
