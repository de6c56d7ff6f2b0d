"""Watching one Horovod job through its :class:`DriverService`, wherever that service runs.

On a classic session the service and its :class:`Supervisor` run on the Spark driver. On Spark
Connect the client cannot be reached from the cluster, so they run in the first barrier task
(``coordinator.py``) and the client reads what they saw from the job's output rows. Both ends
then decide the job's result with the same :func:`conclude`.

The supervisor sends heartbeats, notices ranks that fail (and aborts the others), tasks that go
silent or vanish, tasks that do not start in time and a job that outlives its ``timeout``; the
caller decides how to cancel what does not react to an abort.
"""

import dataclasses
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.outcomes import (
    ERROR,
    HOST_UNREACHABLE,
    OK,
    STATE_PREFIX,
    TASK_LOST,
    RankOutcome,
    pick_failure,
)
from hvd_spark._internal.common.service import KIND, Kind
from hvd_spark.errors import (
    ExecutorPythonError,
    JobDeadlineError,
    JobTimeoutError,
    LaunchError,
    RankFailedError,
    RankStalledError,
)

logger = logging.getLogger(__name__)

CANCEL_AFTER = settings.CANCEL_AFTER  # seconds past abort_grace after which tasks that ignore an abort are cancelled
GIVE_UP_AFTER = settings.GIVE_UP_AFTER  # seconds past abort_grace after which a job ignoring its cancellation is left


@dataclass(frozen=True)
class Problem:
    """A reason the job was stopped that is not a rank's failure (a timeout)."""

    message: str
    ranks: list[int]
    stalled_hosts: dict[int, str] | None = None  # a stall (rank -> host), not a timeout
    counts: dict[int, int] | None = None  # a stall: rank -> its progress marks (steps done) at the stall
    deadline: bool = False  # the whole job's timeout (never restarted), not the tasks' start

    def error(self, message: str | None = None) -> JobTimeoutError:
        if self.stalled_hosts is not None:
            return RankStalledError(message or self.message, ranks=self.ranks, hosts=self.stalled_hosts)
        if self.deadline:
            return JobDeadlineError(message or self.message, ranks=self.ranks)
        return JobTimeoutError(message or self.message, ranks=self.ranks)


@dataclass
class JobReport:
    """What the supervisor knows at the end of a job, beyond the records the tasks return."""

    failures: list[dict] = field(default_factory=list)  # fail messages, in the order they arrived
    lost: list[RankOutcome] = field(default_factory=list)  # ranks whose task went silent
    vanished: list[RankOutcome] = field(default_factory=list)  # ranks whose task's connection closed early
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> the address its task connected from
    problem: Problem | None = None


def _say(level: int, message: str) -> None:
    logger.log(level, "%s", message)


class Supervisor:
    """Watches a job through ``service``; call :meth:`step` about every 0.2 s until the job ends.

    Args:
        service: the job's started DriverService.
        options: the job's LaunchOptions (timeouts, abort grace, heartbeat timeout).
        where: the master URL (or what stands for it), for messages.
        say: ``say(level, message)`` for what the supervisor has to tell the user.
        on_abort: called with the reason when the supervisor tells the tasks to stop.
    """

    def __init__(
        self,
        service,
        options,
        *,
        where: str,
        say: Callable[[int, str], None] = _say,
        on_abort: Callable[[str], None] | None = None,
    ):
        self.service = service
        self.on_abort = on_abort
        self.options = options
        self.where = where
        self.say = say
        self.t0 = time.monotonic()
        self.problem: Problem | None = None
        self.lost: list[RankOutcome] = []
        self.aborted_at: float | None = None
        self.all_done_sent = False
        self._next_beat = self.t0 + settings.HEARTBEAT_INTERVAL

    def _abort(self, reason: str, dump: bool = False) -> None:
        self.service.broadcast({KIND: Kind.ABORT, "reason": reason, "dump": dump})
        self.aborted_at = time.monotonic()
        if self.on_abort is not None:
            self.on_abort(reason)

    def interrupt(self, reason: str) -> None:
        """Tells every task to stop now (the user interrupted the job)."""
        self._abort(reason)

    def step(self) -> None:
        service, opts, num_proc = self.service, self.options, self.service.num_proc
        now = time.monotonic()
        if now >= self._next_beat:
            service.broadcast({KIND: Kind.BEAT})
            self._next_beat = now + settings.HEARTBEAT_INTERVAL
        if not self.lost and self.aborted_at is None:
            # Silent tasks, or tasks whose connection closed before their rank finished (their executor
            # died: Spark may hold the barrier stage open, waiting to run it again on slots that are gone).
            self.lost = _lost_ranks(service, opts.heartbeat_timeout) or _vanished_ranks(service)
            if self.lost:
                what = f"rank {self.lost[0].rank} on host {self.lost[0].host}: {self.lost[0].message}"
                self.say(logging.ERROR, f"{what}; stopping the other ranks")
                self._abort(what)
        started, _, done, failures, _ = service.snapshot()
        if failures and self.aborted_at is None:
            first = failures[0]
            self.say(logging.ERROR, f"rank {first['rank']} failed ({first['type']}); stopping the other ranks")
            self._abort(f"rank {first['rank']} failed")
        if len(done) == num_proc and not self.all_done_sent:
            service.broadcast({KIND: Kind.ALL_DONE})
            self.all_done_sent = True
        if self.problem is None and len(started) < num_proc and now - self.t0 > opts.start_timeout:
            missing = sorted(set(range(num_proc)) - set(started))
            self.problem = Problem(start_timeout_message(missing, num_proc, opts, self.where), missing)
        if self.problem is None and opts.timeout is not None and now - self.t0 > opts.timeout:
            missing = sorted(set(range(num_proc)) - set(done))
            self.problem = Problem(
                f"the job did not finish within timeout={opts.timeout:g}s; ranks {missing} had not finished.",
                missing,
                deadline=True,
            )
        if self.problem is None and opts.stall_timeout is not None and self.aborted_at is None:
            self.problem = self._stall(opts.stall_timeout)
            if self.problem is not None:
                self.say(logging.ERROR, f"{self.problem.message}; stopping the job")
        if self.problem is not None and self.aborted_at is None:
            self._abort(self.problem.message, dump=True)

    def _stall(self, timeout: float) -> Problem | None:
        """A Problem when ranks' progress stood still for ``timeout`` seconds (the stall watchdog),
        its ranks in the service's order: the rank furthest behind first."""
        stalled = self.service.stalled_ranks(timeout)
        if not stalled:
            return None
        _, rank_of, _, _, _ = self.service.snapshot()
        host_of = {rank_of[p]: h for p, h in self.service.host_of.items() if p in rank_of}
        hosts = {rank: host_of.get(rank, "?") for rank, *_ in stalled}
        parts = [
            f"rank {rank} on host {hosts[rank]}: none for {quiet:.0f} s, last at {where or '?'} (count {count})"
            for rank, quiet, count, where in stalled
        ]
        return Problem(
            f"stalled: no rank made progress for stall_timeout={timeout:g}s, the rank furthest behind first "
            "(the lowest progress count, then the longest silent): " + "; ".join(parts),
            [rank for rank, *_ in stalled],
            stalled_hosts=hosts,
            counts={rank: count for rank, _, count, _ in stalled},
        )

    def should_cancel(self) -> bool:
        """True once the tasks had ``abort_grace`` + 10 s to react to an abort and the job goes on."""
        return cancel_due(self.aborted_at, self.options, time.monotonic())

    def should_give_up(self, cancelled_at: float | None = None) -> bool:
        """True when the job still runs long after its cancellation: stop waiting for it."""
        if cancelled_at is None and self.aborted_at is not None:
            cancelled_at = self.aborted_at + self.options.abort_grace + CANCEL_AFTER
        return give_up_due(cancelled_at, time.monotonic())

    def settled(self) -> bool:
        """Every task that started has closed its connection, after all of them started or the job
        was stopped: nothing more will be heard (the coordinator's end on Spark Connect)."""
        started, _, _, _, open_tasks = self.service.snapshot()
        return not open_tasks and (len(started) == self.service.num_proc or self.aborted_at is not None)

    def report(self) -> JobReport:
        service = self.service
        _, rank_of, _, failures, _ = service.snapshot()
        hosts = {rank_of.get(p): h for p, h in service.host_of.items() if rank_of.get(p) is not None}
        return JobReport(
            failures=failures,
            lost=list(self.lost),
            vanished=_vanished_ranks(service),
            hosts=hosts,
            problem=self.problem,
        )


# --- The timing rules of a job's end, shared by the Supervisor (beside the driver service) and the
# Spark Connect client's watch (which sees only the channel and the stage) ---


def cancel_due(aborted_at: float | None, options, now: float) -> bool:
    """Whether tasks told to abort at ``aborted_at`` had their ``abort_grace`` + CANCEL_AFTER to stop:
    past that, they are cancelled through Spark."""
    return aborted_at is not None and now - aborted_at > options.abort_grace + CANCEL_AFTER


def give_up_due(cancelled_at: float | None, now: float) -> bool:
    """Whether a job cancelled through Spark at ``cancelled_at`` still runs so long after that nothing
    more is waited for (its result is decided from what is known)."""
    return cancelled_at is not None and now - cancelled_at > GIVE_UP_AFTER - CANCEL_AFTER


def overrun_due(t0: float, options, now: float) -> bool:
    """Whether a job with a ``timeout`` outlived it by so much that the component that enforces it
    (the supervisor) must be gone: the job is cancelled from outside."""
    return options.timeout is not None and now - t0 > options.timeout + options.abort_grace + 2 * CANCEL_AFTER


def start_timeout_message(missing: list[int], num_proc: int, options, where: str) -> str:
    """Why a job stopped before all its tasks started; ``missing`` is empty when the watcher cannot
    tell which ones (a Spark Connect client)."""
    if missing:
        what = f"{len(missing)} of {num_proc} barrier tasks (tasks/partitions {missing}) did not start"
    else:
        what = f"the {num_proc} barrier tasks did not all start"
    return (
        f"{what} within start_timeout={options.start_timeout:g}s. Spark could not schedule them all at once: "
        f"check that {num_proc} task slots are free (master={where}) or raise start_timeout "
        f"({settings.ENV_START_TIMEOUT})."
    )


class ClientWatch:
    """A Spark Connect client's watch over a job whose Supervisor runs in the coordinator task.

    The client sees only the channel's records (``start``, ``abort``) and whether the stage still
    runs; it applies the Supervisor's rules to them: the tasks must start within ``start_timeout``,
    tasks that ignore an abort are interrupted (:func:`cancel_due`), a job that outlives its
    timeout is interrupted (:func:`overrun_due`), and an interrupted job that goes on is left
    (:func:`give_up_due`). ``interrupt(reason)`` cancels the stage (``spark.interruptTag``).
    """

    def __init__(self, options, num_proc: int, where: str, interrupt: Callable[[str], None], *, live: bool):
        self.options, self.num_proc, self.where, self._interrupt = options, num_proc, where, interrupt
        self.live = live  # a channel is read: starts and aborts are seen
        self.t0 = time.monotonic()
        self.started = False
        self.aborted_at: float | None = None
        self.cancelled_at: float | None = None
        self.problem: JobTimeoutError | None = None

    def interrupt(self, why: str, now: float | None = None) -> None:
        if self.cancelled_at is None:
            self._interrupt(why)
            self.cancelled_at = time.monotonic() if now is None else now

    def see(self, records: list[dict], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.started = self.started or any(r.get("k") == "start" for r in records)
        if self.aborted_at is None and any(r.get("k") == "abort" for r in records):
            self.aborted_at = now

    def step(self, now: float | None = None) -> bool:
        """Applies the rules at ``now``; False when the job is to be left (stop waiting for it)."""
        now = time.monotonic() if now is None else now
        opts = self.options
        if self.live and not self.started and self.problem is None and now - self.t0 > opts.start_timeout:
            self.problem = JobTimeoutError(
                start_timeout_message([], self.num_proc, opts, self.where), ranks=list(range(self.num_proc))
            )
            self.interrupt("its tasks did not start in time", now)
        if cancel_due(self.aborted_at, opts, now):
            self.interrupt("its tasks did not stop after an abort", now)
        if overrun_due(self.t0, opts, now):
            self.interrupt("it outlived its timeout and its coordinator did not stop it", now)
        return not give_up_due(self.cancelled_at, now)


def _lost_ranks(service, timeout: float) -> list[RankOutcome]:
    """Failures for the tasks that sent nothing (not even a heartbeat) for ``timeout`` seconds."""
    out = []
    for _partition, rank, host, quiet in service.silent_tasks(timeout):
        out.append(
            RankOutcome(
                rank=rank if rank is not None else -1,
                status=ERROR,
                type=HOST_UNREACHABLE,
                message=(
                    f"its task sent nothing for {quiet:.0f} s (tasks send a heartbeat every "
                    f"{settings.HEARTBEAT_INTERVAL:g} s; {settings.ENV_HEARTBEAT_TIMEOUT}={timeout:g}): the host "
                    "stopped answering (network down or dropped, machine frozen or lost)"
                ),
                time=time.time(),
                host=host,
            )
        )
    return out


def _vanished_ranks(service) -> list[RankOutcome]:
    """Failures for the ranks whose task's connection closed before they finished."""
    out = []
    for partition, when in service.vanished.items():
        rank = service.rank_of_partition.get(partition)
        if rank is None:
            continue
        out.append(
            RankOutcome(
                rank=rank,
                status=ERROR,
                type=TASK_LOST,
                message=(
                    "its Spark task ended without a result and without reporting an error: the executor "
                    "or its host went away (killed, out of memory, lost)"
                ),
                time=when,
                host=service.host_of.get(partition, ""),
            )
        )
    return out


def _raise_failure(rec: RankOutcome) -> None:
    err = RankFailedError(rec.rank, rec.type or "?", rec.message, rec.traceback, host=rec.host)
    cause = None
    if rec.pickled:
        try:
            cause = cloudpickle.loads(rec.pickled)
        except Exception:  # the exception's class may not exist on the driver
            cause = None
    if isinstance(cause, BaseException):
        raise err from cause
    raise err


def _stacks(records: list[RankOutcome], ranks: list[int]) -> dict[int, tuple[str, list[str] | None]]:
    """rank -> (its process's state or "", its Python frames innermost first, or None when it printed
    no stack), for the listed ranks, from what their tasks kept of their output after an abort."""
    out = {}
    for rec in records:
        if rec.rank not in ranks:
            continue
        tail = rec.tail or ()
        states = [line[len(STATE_PREFIX) :] for line in tail if line.startswith(STATE_PREFIX)]
        starts = [
            i for i, line in enumerate(tail) if line.startswith(("Stack (most recent call first)", "Current thread"))
        ]
        frames = (
            [line.strip() for line in tail[starts[-1] + 1 :] if line.strip().startswith("File ")] if starts else None
        )
        if frames is not None or states:
            out[rec.rank] = (states[-1] if states else "", frames)
    return out


def _where_ranks_were(stacks: dict[int, tuple[str, list[str] | None]], ranks: list[int]) -> str:
    """The innermost Python frames of each listed rank, with the state of its process (a stopped
    process prints nothing)."""
    out = []
    for rank in [r for r in ranks if r in stacks]:
        state, frames = stacks[rank]
        label = f"  rank {rank}" + (f" (process {state})" if state else "")
        if frames is None:
            out.append(f"{label}: no stack: the process did not answer SIGUSR1")
        else:
            out.append(f"{label}: " + " <- ".join(frames[:6]))
    return "\n".join(out)


def _stall_suspects(stacks: dict[int, tuple[str, list[str] | None]]) -> tuple[list[int], str]:
    """The ranks that the stacks say most likely stalled the others, and why: stopped or silent
    processes, else the ranks outside any Horovod collective while others wait in one (a
    collective they never joined); ``([], "")`` when the stacks do not tell."""
    silent = [r for r, (state, frames) in stacks.items() if frames is None or state in ("stopped", "tracing-stop")]
    if silent:
        return sorted(silent), "stopped or silent: no Python stack"
    waiting = {r for r, (_, frames) in stacks.items() if frames and any("horovod" in f for f in frames)}
    elsewhere = sorted(set(stacks) - waiting)
    if waiting and elsewhere:
        return elsewhere, "outside the Horovod collective the others wait in"
    return [], ""


def _behind(ranks: list[int], counts: dict[int, int]) -> tuple[list[int], str]:
    """The ranks with the lowest progress count and how far behind they are, when the counts
    differ; else ``([], "")``."""
    known = {r: counts[r] for r in ranks if r in counts}
    if len(set(known.values())) < 2:
        return [], ""
    low = min(known.values())
    others = sorted({c for c in known.values() if c != low})
    reached = f"{others[0]}" if len(others) == 1 else f"{others[0]} to {others[-1]}"
    return [r for r in ranks if known.get(r) == low], f"progress count {low}, the others {reached}"


def explain_problem(problem: Problem, stacks: dict[int, tuple[str, list[str] | None]]) -> tuple[str, list[int]]:
    """The message of a job stopped for ``problem`` and its ranks in the order to report them, from
    the ranks' stacks after the abort (``rank -> (process state, frames or None)``).

    A stall adds the line ``Most likely stalled: rank(s) [...]`` and names those ranks first. The
    evidence, strongest first: a process that is stopped or printed no stack; a rank outside any
    Horovod collective while others wait in one; the lowest progress count (the rank that finished
    fewer steps is behind: the others wait for it). When the stacks tell, their ranks are the
    likely ones, and the line also names the ranks with the lowest count when those differ. When
    the stacks do not tell (none came back, every rank is in user code, or they name every rank)
    and the counts differ, the ranks with the lowest count are the likely ones. The other ranks keep the problem's order
    (lowest count first). Every problem then lists where each unfinished rank was."""
    message, ranks = problem.message, list(problem.ranks)
    if problem.stalled_hosts is not None:
        suspects, why = _stall_suspects(stacks)
        suspects = [r for r in ranks if r in suspects]
        if len(ranks) > 1 and len(suspects) == len(ranks):
            suspects = []  # stacks that name every rank single out none
        behind, how_far = _behind(ranks, problem.counts or {})
        line = ""
        if suspects and behind and set(behind) != set(suspects):
            line = (
                f"{suspects} ({why}); the progress counts put rank(s) {behind} behind ({how_far}), "
                "the stacks weigh more"
            )
        elif suspects:
            line = f"{suspects} ({why}" + (f"; behind the others: {how_far})" if behind else ")")
        elif behind:
            suspects, line = behind, f"{behind} (behind the others: {how_far})"
        if suspects:
            message += f"\nMost likely stalled: rank(s) {line}"
            ranks = suspects + [r for r in ranks if r not in suspects]
    where = _where_ranks_were(stacks, ranks)
    if where:
        message += f"\nWhere each unfinished rank was:\n{where}"
    return message, ranks


def _is_shutdown(rec) -> bool:
    """A rank's failure that only says Horovod was shut down under it (another rank was stopped)."""
    return "Horovod has been shut down" in (getattr(rec, "message", "") or "")


def conclude(
    records: list[RankOutcome],
    report: JobReport,
    *,
    num_proc: int,
    description: str,
    elapsed: float,
    stage_error: BaseException | None = None,
) -> list[Any]:
    """The job's return values by rank, or the error that explains why there are none: a rank's
    failure first (the cause, not its consequences), then a timeout, then the stage's own error."""
    records = [dataclasses.replace(r, host=report.hosts.get(r.rank, r.host)) for r in records]
    errors = [r for r in records if r.status == ERROR] + list(report.lost)
    # Failures reported, whose task's record did not come back (the job was cancelled), and ranks
    # whose task vanished without a word (its executor or host died).
    returned = {r.rank for r in records}
    errors += [
        dataclasses.replace(RankOutcome.from_message(f), host=report.hosts.get(int(f["rank"]), ""))
        for f in report.failures
        if int(f["rank"]) not in returned
    ]
    known = returned | {r.rank for r in errors}
    errors += [v for v in report.vanished if v.rank not in known]
    if report.problem is not None and errors and all(_is_shutdown(e) for e in errors):
        errors = []  # ranks stopped for the timeout or stall failed in their collectives: the problem explains it
    if errors:
        _raise_failure(pick_failure(errors))
    if report.problem is not None:
        message, ranks = explain_problem(report.problem, _stacks(records, report.problem.ranks))
        raise dataclasses.replace(report.problem, ranks=ranks).error(message)
    if stage_error is not None:
        from hvd_spark._internal.common.requirements import executor_python_problem

        problem = executor_python_problem(str(stage_error))
        if problem is not None:  # the executors' Python cannot run hvd_spark: one line that says how to fix it
            version = importlib.import_module("hvd_spark").__version__
            raise ExecutorPythonError("", problem, version) from stage_error
        raise LaunchError(f"the Spark barrier stage of {description} failed: {stage_error}") from stage_error
    by_rank = {r.rank: r for r in records}
    missing = sorted(set(range(num_proc)) - set(by_rank))
    if missing:
        raise LaunchError(f"ranks {missing} returned no result (job ended after {elapsed:.1f}s).")
    not_ok = [r for r in by_rank.values() if r.status != OK or r.result is None]
    if not_ok:
        raise LaunchError(f"ranks {sorted(r.rank for r in not_ok)} were aborted without a reported failure.")
    logger.info("%d ranks finished in %.1fs", num_proc, elapsed)
    return [cloudpickle.loads(by_rank[r].result) for r in range(num_proc)]
