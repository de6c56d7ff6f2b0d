"""What each Spark barrier task does: rendezvous, start its rank's process, watch it, report.

This runs inside Spark's Python worker. The barrier closure shipped by the launcher calls
:func:`run_task` with plain values only (no SparkSession, no ``self``). On Spark Connect the first
task also runs the job's coordinator (``driver/coordinator.py``), and every task reaches it as it
would reach the driver.
"""

import collections
import dataclasses
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
from hvd_spark._internal.task import netcheck, warm
from hvd_spark._internal.task.procs import kill_tree, popen_args, signal_name

TAIL_LINES = settings.TAIL_LINES
ENV_WORKDIR = settings.ENV_WORKDIR  # where an MPI rank finds its payload and leaves its result


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
            failed: RankOutcome = cloudpickle.load(f)
        if aborted and not failed.tail:
            # It failed while being stopped (a peer stopped first ended its collective): what it
            # printed is kept, with the stack it dumped for the driver's report.
            failed = dataclasses.replace(failed, tail=tuple(tail or ()))
        return failed
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
        outcome = RankOutcome(me.rank, ABORTED)
        _report(client, outcome)  # done (not ok): its connection closing is no lost task
        return outcome
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
            from hvd_spark._internal.task.mpi import run_mpi

            return run_mpi(spec, client, me, ranks, workdir)

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


def _wait_for_end(watch: _Watch) -> None:
    """Blocks until the driver says every rank is done, or aborts the job (or goes away)."""
    while not (watch.all_done.is_set() or watch.abort.is_set()):
        watch.all_done.wait(0.2)


def _write_payload(spec: TaskSpec, workdir: str) -> None:
    with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
        f.write(spec.payload)


def _supervise(proc: subprocess.Popen, watch: _Watch, grace: float) -> bool:
    """Waits for ``proc``; on an abort, stops it. Returns True when it was aborted."""
    while True:
        try:
            proc.wait(timeout=0.05)  # a finished rank is seen within 50 ms: its task reports it at once
            return False
        except subprocess.TimeoutExpired:
            pass
        if watch.abort.is_set():
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


def _run_watched(cmd: list[str], env: dict, workdir: str, watch: _Watch, grace: float, warm_proc=None):
    """Starts ``cmd`` in its own process group (killed if this task dies), forwards its output and
    waits for it, stopping it on an abort. ``warm_proc``, a rank a warm server forked, replaces the
    fresh process. Returns (exit code, whether it was aborted)."""
    proc = warm_proc or subprocess.Popen(
        **popen_args(cmd),  # its own process group, dying with this task (no preexec_fn: see procs.py)
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
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
    env[settings.ENV_RANK_STARTED] = repr(time.time())  # the rank's start-up profile counts from here
    # What the driver decided, unless it had nothing to go on: then this executor's own setting counts.
    use_warm = spec.warm and (spec.warm_set or settings.WARM.get(env=os.environ))
    warm_proc = warm.spawn(env, workdir, spec.app, spec.start_timeout) if use_warm else None
    rc, aborted = _run_watched(
        [sys.executable, "-m", "hvd_spark._internal.rank.entry", workdir],
        env,
        workdir,
        watch,
        spec.abort_grace,
        warm_proc,
    )
    return _outcome(workdir, rank, rc, aborted, list(watch.tails[rank])), watch
