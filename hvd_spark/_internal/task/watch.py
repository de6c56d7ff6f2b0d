"""Watching a rank's process from its Spark barrier task: its output forwarded to the driver (and
its last lines kept), aborts and the driver's silence, its end, and the outcome the task reports.

Shared by the two ways a task runs its ranks: one process per task (:mod:`.barrier`) and ``mpirun``
for the whole job (:mod:`.mpi`).
"""

import collections
import dataclasses
import os
import re
import signal
import subprocess
import threading
import time

import cloudpickle

from hvd_spark._internal.common import logs, settings
from hvd_spark._internal.common.outcomes import ABORTED, ERROR, OK, PROCESS_DIED, STATE_PREFIX, RankOutcome, TaskSpec
from hvd_spark._internal.common.service import KIND, Kind, TaskClient
from hvd_spark._internal.task.procs import kill_tree, popen_args, signal_name

TAIL_LINES = settings.TAIL_LINES
ENV_WORKDIR = settings.ENV_WORKDIR  # where an MPI rank finds its payload and leaves its result


class Watch:
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

    def warn(self, line: str) -> None:
        """A line of the task's own about its rank (a warm server not ready): in the rank's last lines,
        and a warning on the driver whatever its ``verbose``."""
        self.tails[self.default_rank].append(line)
        self.client.send({KIND: Kind.LOG, "rank": self.default_rank, "line": line, "level": "warning"})


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


def read_outcome(workdir: str, rank: int, rc: int | None, aborted: bool, tail, cause: str = "") -> RankOutcome:
    """Reads what a rank left in ``workdir``: its result, its error, or how its process ended (and
    ``cause``, what ended it when known: its warm server's end)."""
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
    if cause:
        how += f": {cause}"
    return RankOutcome(
        rank,
        ERROR,
        type=PROCESS_DIED,
        message=how,
        traceback="Last output lines:\n" + "\n".join(tail or []),
        time=time.time(),
    )


def report(client: TaskClient, outcome: RankOutcome) -> None:
    if outcome.status == ERROR:
        client.send({KIND: Kind.FAIL, **outcome.to_message()})
    client.send({KIND: Kind.DONE, "rank": outcome.rank, "ok": outcome.status == OK})


def wait_for_end(watch: Watch) -> None:
    """Blocks until the driver says every rank is done, or aborts the job (or goes away)."""
    while not (watch.all_done.is_set() or watch.abort.is_set()):
        watch.all_done.wait(0.2)


def write_payload(spec: TaskSpec, workdir: str) -> None:
    with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
        f.write(spec.payload)


def _supervise(proc: subprocess.Popen, watch: Watch, grace: float) -> bool:
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


def run_watched(cmd: list[str], env: dict, workdir: str, watch: Watch, grace: float, warm_proc=None):
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
