"""The training attempts of a fit, as a small state machine: the :class:`Controller` goes through
``SCHEDULING`` (the first attempt's ranks), ``RUNNING`` (one attempt from the latest checkpoint or
commit), ``RESTARTING`` (after a failure) and ``RESIZING`` (after the ranks stopped to grow), and
ends ``FINISHED`` or ``ERRORED``. It asks a failure policy whether a failed attempt starts again
and a scaling policy how many ranks the next one has (``ml/policies.py``); every restart and resize
is accounted for in one place (:class:`RecoveryLog`).

No Spark: the ranks run through a backend of horovod.spark's shape (``ml/backend.py``), so the fast
tests drive the controller with ranks played in process.
"""

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common.contracts import AttemptStart, Recovery, RunConfig, Shares
from hvd_spark._internal.common.restarts import RESTARTABLE
from hvd_spark._internal.data.leases import Lease
from hvd_spark._internal.data.stops import ended_model
from hvd_spark._internal.data.store import Checkpoint, Store
from hvd_spark._internal.ml.policies import (
    Elastic,
    ElasticScaling,
    FailureDecision,
    FailurePolicy,
    FixedScaling,
    ScalingPolicy,
)
from hvd_spark.errors import JobDeadlineError, JobTimeoutError, RankStalledError, RunInUseError

logger = logging.getLogger(__name__)


class State(enum.Enum):
    SCHEDULING = "scheduling"  # sizing the first attempt
    RUNNING = "running"  # an attempt from the latest checkpoint or commit
    RESTARTING = "restarting"  # an attempt failed: the failure policy decides, the scaling policy sizes the next
    RESIZING = "resizing"  # the ranks stopped at an epoch end so that the next attempt grows
    FINISHED = "finished"
    ERRORED = "errored"


@dataclasses.dataclass(frozen=True)
class Trained:
    """What the training attempts of a fit ended with."""

    results: list[dict]  # the last attempt's per-rank results, in rank order
    restarts: int  # failed attempts that were started again
    seconds: float  # the attempts' time, launch to end
    recoveries: tuple[Recovery, ...] = ()  # every restart and resize, in order


class AttemptProbe:
    """What the driver hears from rank 0 of the running attempt (an ``on_event`` listener): when it
    finished its first step and the optimizer step it last reported (``position`` events)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.first_step_at: float | None = None
        self.iterations: int | None = None

    def new_attempt(self) -> None:
        self.first_step_at = None
        self.iterations = None

    def __call__(self, rank: int, payload: dict) -> None:
        if payload.get("kind") != "position":
            return
        if self.first_step_at is None:
            self.first_step_at = float(payload.get("time") or self.clock())
        self.iterations = int(payload.get("iterations", 0))


class RecoveryLog:
    """Every restart and resize of a fit, in order. One begins when an attempt fails or stops to grow,
    and is completed (its time to the next first step, from the probe) when the next attempt ends or
    fails in its turn; each is logged once complete."""

    def __init__(self, probe: AttemptProbe):
        self.probe = probe
        self.done: list[Recovery] = []
        self._pending: dict | None = None

    def begin(
        self,
        kind: str,
        cause: str,
        from_size: int,
        to_size: int,
        resumed_from: str,
        failed_at: float | None = None,
        **more,
    ) -> None:
        """``resumed_from``: the checkpoint's position (or "the start", a commit); ``failed_at``: when the
        attempt failed or stopped (None: now); the recovery's time runs from it."""
        self._pending = dict(
            kind=kind,
            cause=cause,
            from_size=from_size,
            to_size=to_size,
            resumed_from=resumed_from,
            failed_at=time.time() if failed_at is None else failed_at,
            **more,
        )

    def close(self) -> None:
        """Completes the recovery under way (its time unknown when the attempt after it made no step)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        failed_at = pending.pop("failed_at")
        seconds = self.probe.first_step_at - failed_at if self.probe.first_step_at else None
        recovery = Recovery(**pending, seconds=seconds)
        self.done.append(recovery)
        logger.warning("recovery: %s", recovery.describe())


def sized(cfg: RunConfig, num_proc: int) -> RunConfig:
    """``cfg`` for an attempt on ``num_proc`` ranks: training files per rank (the petastorm reader),
    validation files per rank (each file read by exactly one rank), steps per epoch (each rank's share
    of an epoch once, or the user's ``train_steps_per_epoch``) and validation steps."""
    from hvd_spark._internal.common.dataplan import steps_for
    from hvd_spark._internal.common.specs import assign_files, steps_per_epoch

    r = cfg.reading
    train_rows = sum(n for _, n in r.train_table)
    val_rows = sum(n for _, n in r.val_table) + sum(u[2] for u in r.val_units)
    train_files = assign_files(list(r.train_table), num_proc)[0] if r.train_table else cfg.shares.train_files
    if r.val_units:  # a table read in place: each rank reads its share of the validation rows (train.py)
        val_files: list | None = [[] for _ in range(num_proc)]
    else:
        val_files = assign_files(list(r.val_table), num_proc, share=False)[0] if val_rows else None
    if r.fixed_steps:
        steps = r.fixed_steps
    elif r.train_units:  # the planned reader: each rank reads floor(rows / ranks) rows once
        steps = max(1, steps_for(train_rows // num_proc, r.batch_size))
    else:
        steps = steps_per_epoch(train_rows, r.batch_size, num_proc)
    val_steps = (r.fixed_val_steps or steps_per_epoch(val_rows, r.val_batch_size, num_proc)) if val_files else None
    return dataclasses.replace(cfg, shares=Shares(train_files, val_files, int(steps), val_steps))


def commit_iterations(store: Store, ckpt: Checkpoint | None) -> int:
    """The optimizer steps recorded with ``ckpt`` (0: none, or no checkpoint)."""
    if ckpt is None:
        return 0
    try:
        return int(store.files.read_json(ckpt.meta_path).get("iterations") or 0)
    except FileNotFoundError:
        return 0


class FitJob:
    """A fit's training attempts, as the :class:`Controller` runs them: each one ``rank_fn(cfg)`` from the
    run's latest complete checkpoint or commit (none: from the user's model, ``model_bytes()``); an
    attempt after the run's last epoch, or after its early stop (``data/stops.py``), only puts the model
    the run ended with in place."""

    def __init__(self, rank_fn: Callable[..., Any], cfg: RunConfig, store: Store, model_bytes: Callable[[], bytes]):
        self.rank_fn, self.cfg, self.store, self.model_bytes = rank_fn, cfg, store, model_bytes
        self.label = f"run '{cfg.run_id}'"
        self.resize_marker = cfg.commits.resize_marker
        self._cached_model: bytes | None = None
        self._stop: dict | None = None  # the early stop recorded with the checkpoint the next attempt starts from

    def size_to(self, size: int) -> None:
        self.cfg = sized(self.cfg, size) if self.cfg.reading.train_table else self.cfg

    def next_attempt(self) -> tuple[Callable[..., Any], tuple, dict] | list[dict]:
        """The next attempt's rank function and arguments; or, when no training is left, the results."""
        cfg, resume = self._attempt_config()
        self.cfg = cfg
        if resume is not None and (resume.epoch >= cfg.epochs or self._stop):
            # The attempt before had finished training (all its epochs, or stopped early by its callbacks: the
            # run's stop). Its model: the one its end record names when it was uploaded before another rank
            # failed, else the checkpoint (of EarlyStopping's best epoch when that restores its best weights).
            source = ended_model(self.store, cfg.run_id, resume, stopped=self._stop is not None)
            if self._stop:
                logger.info(
                    "%s was stopped at %s by %s: no more training", self.label, resume.position, self._stop.get("by")
                )
            if source != cfg.commits.final_model:  # uploaded by the attempt that then failed: it stays as it is
                self.store.files.copy_file(source, cfg.commits.final_model)
            return [
                {"rank": 0, "weights_digest": "", "epoch_logs": list(cfg.start.history_so_far), "stopped": self._stop}
            ]
        return self.rank_fn, (cfg,), {}

    def _attempt_config(self) -> tuple[RunConfig, Checkpoint | None]:
        """The next attempt's configuration: from the latest checkpoint (damaged ones set aside: this fit
        holds the run), else from the user's model."""
        store, cfg = self.store, self.cfg
        resume = store.latest_checkpoint(cfg.run_id, set_aside=True)
        if resume is not None:
            logger.info("resuming run '%s' from %s of %d epochs", cfg.run_id, resume.position, cfg.epochs)
        elif self._cached_model is None:
            self._cached_model = self.model_bytes()
        meta = store.files.read_json(resume.meta_path) if resume else {}
        self._stop = meta.get("stopped") if resume is not None and not resume.step else None
        start = AttemptStart(
            initial_epoch=resume.epoch if resume else 0,
            resume_ckpt=resume.model_path if resume else None,
            history_so_far=tuple(meta.get("history", ())) if resume else (),
            model_bytes=None if resume else self._cached_model,
            resume_step=resume.step if resume else 0,
            resume_cursor=meta.get("cursor") if resume else None,
            callback_states=tuple(meta["callbacks"]) if resume and meta.get("callbacks") else None,
        )
        return dataclasses.replace(cfg, start=start), resume

    def resume_point(self) -> tuple[str, str, int]:
        """Where the next attempt starts: for the log, for the recovery's record, and the optimizer steps
        done by then."""
        latest = self.store.latest_checkpoint(self.cfg.run_id)
        if latest is None:
            return "the start", "the start", 0
        return f"the checkpoint of {latest.position}", latest.position, commit_iterations(self.store, latest)

    def taken_over(self, e: BaseException) -> RunInUseError:
        run_id, store = self.cfg.run_id, self.store
        return RunInUseError(
            f"run_id '{run_id}' in {store.prefix} was taken over by another fit while this one trained "
            f"(its writer lease {store.run_path(run_id)}/_writer.json is no longer this fit's); this fit "
            f"stopped before writing another checkpoint. Cause: {str(e).splitlines()[0]}",
            run_id=run_id,
        )

    def clear_marker(self) -> None:
        if self.resize_marker:  # a request left by an earlier attempt (or fit) is not this attempt's
            self.store.files.rm(self.resize_marker)


class RunJob:
    """``hvd_spark.run``'s attempts, as the :class:`Controller` runs them: each calls ``fn`` anew on every
    rank, where :func:`hvd_spark.committed_state` returns what rank 0 last committed (``keeper``, the
    backend's ``on_event`` listener)."""

    label = "hvd_spark.run"
    store = None
    resize_marker = None  # an attempt is never asked to stop to grow: it runs to its end

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict | None, keeper: Any):
        self.fn, self.args, self.kwargs, self.keeper = fn, tuple(args), dict(kwargs or {}), keeper

    def size_to(self, size: int) -> None:
        pass

    def next_attempt(self) -> tuple[Callable[..., Any], tuple, dict]:
        from hvd_spark._internal.common.commits import Restoring

        return Restoring(self.fn, self.keeper.state), self.args, self.kwargs

    def resume_point(self) -> tuple[str, str, int]:
        if self.keeper.state is None:
            return "the start (nothing committed)", "the start", 0
        return f"commit {self.keeper.commits}", f"commit {self.keeper.commits}", 0

    def taken_over(self, e: BaseException) -> BaseException:
        raise AssertionError("hvd_spark.run holds no run: its failure policy (holds_run=False) never decides so")

    def clear_marker(self) -> None:
        pass


class Controller:
    """Runs a job's attempts (``job``: a fit's, :class:`FitJob`, made from ``rank_fn``, ``cfg``, ``store``
    and ``model_bytes``; or ``hvd_spark.run``'s, ``ml/jobs.py``'s ``RunJob``): one ``backend.run`` per
    attempt, until one finishes or the failure policy says no.

    ``states`` lists the states it went through, in order (the tests read it).
    """

    def __init__(
        self,
        backend: Any,
        rank_fn: Callable[..., Any] | None = None,
        cfg: RunConfig | None = None,
        store: Store | None = None,
        *,
        failure: FailurePolicy,
        scaling: ScalingPolicy,
        model_bytes: Callable[[], bytes] | None = None,
        lease: Lease | None = None,
        probe: AttemptProbe | None = None,
        job: Any = None,
    ):
        if job is None:
            assert rank_fn is not None and cfg is not None and store is not None and model_bytes is not None
            job = FitJob(rank_fn, cfg, store, model_bytes)
        self.backend, self.job = backend, job
        self.failure, self.scaling, self.lease = failure, scaling, lease
        self.probe = probe or AttemptProbe()
        self.recoveries = RecoveryLog(self.probe)
        self.states: list[State] = []
        self.restarts = 0
        self.size = 0
        self.lost_hosts: set[str] = set()  # hosts whose executor or network went away in a failed attempt
        self.results: list = []
        self._error: BaseException | None = None  # the failure RESTARTING decides on
        self._failed_at = 0.0  # when it happened (or the ranks stopped to grow): a recovery's time runs from there

    def run(self) -> Trained:
        """Raises what :func:`train_with_restarts` documents."""
        t0 = time.time()
        handlers = {
            State.SCHEDULING: self._schedule,
            State.RUNNING: self._run_attempt,
            State.RESTARTING: self._restart,
            State.RESIZING: self._resize,
        }
        state = State.SCHEDULING
        try:
            while state is not State.FINISHED:
                self.states.append(state)
                state = handlers[state]()
        except BaseException:
            self.states.append(State.ERRORED)
            raise
        self.states.append(State.FINISHED)
        self.recoveries.close()
        return Trained(self.results, self.restarts, time.time() - t0, tuple(self.recoveries.done))

    def _size_to(self, size: int) -> None:
        self.size = size
        self.backend = self.scaling.backend_for(self.backend, size)
        self.job.size_to(size)

    def _schedule(self) -> State:
        self._size_to(self.scaling.first_size(self.backend))
        return State.RUNNING

    def _run_attempt(self) -> State:
        attempt = self.job.next_attempt()
        if isinstance(attempt, list):  # nothing left to train
            self.results = attempt
            return State.FINISHED
        fn, args, kwargs = attempt
        self.probe.new_attempt()
        self.job.clear_marker()
        try:
            with self.scaling.watch(self.backend, self.job.store, self.job.resize_marker, self.size):
                results = list(self.backend.run(fn, args=args, kwargs=kwargs))
        except JobTimeoutError as e:
            self._failed_at = time.time()
            if not self.lost_hosts or isinstance(e, RankStalledError | JobDeadlineError):
                self._error = e
            else:
                self._error = JobTimeoutError(
                    f"{e} The previous training attempt lost host(s) {sorted(self.lost_hosts)}; the application "
                    "has fewer task slots until they return.",
                    ranks=e.ranks,
                )
                self._error.__cause__ = e
            return State.RESTARTING
        except RESTARTABLE as e:
            self._failed_at = time.time()
            self._error = e
            return State.RESTARTING
        self.recoveries.close()
        self.results = results
        if self.job.resize_marker and self.scaling.resizes and any(r.get("stopped_for_resize") for r in results):
            self._failed_at = time.time()  # the ranks stopped: the slot wait counts in the resize's time
            return State.RESIZING
        return State.FINISHED

    def _restart(self) -> State:
        e, self._error = self._error, None
        assert e is not None
        decision = self.failure.decide(e, self.restarts, lease_lost=self.lease is not None and self.lease.lost.is_set())
        if decision is FailureDecision.TAKEN_OVER:
            raise self.job.taken_over(e) from e
        lost = self.failure.lost_host(e)
        if lost:
            self.lost_hosts.add(lost)
        if decision is FailureDecision.RAISE:
            raise e
        try:
            return self._start_again(e, lost)
        except BaseException as raised:  # e.g. too few slots for too long: shown after the failure it follows
            if raised is not e and raised.__context__ is None:
                raised.__context__ = e
            raise

    def _start_again(self, e: BaseException, lost: str | None) -> State:
        self.recoveries.close()  # the recovery before this attempt
        self.restarts += 1
        said, resumed_from, committed = self.job.resume_point()
        reached = self.probe.iterations
        redone = max(0, reached - committed) if reached is not None else None
        size = self.size
        new_size = self.scaling.after_failure(self.backend, size, lost, self.restarts)
        logger.warning(
            "attempt %d of %s failed (%s); restarting (%d of max_restarts=%d) on %d ranks from %s",
            self.restarts,
            self.job.label,
            # a timeout's or stall's whole report (where each rank was); a failure's first line
            str(e) if isinstance(e, JobTimeoutError) else str(e).splitlines()[0],
            self.restarts,
            self.failure.max_restarts,
            new_size,
            said,
        )
        kind = "restart" if new_size == size else ("shrink" if new_size < size else "grow")
        self.recoveries.begin(
            kind,
            str(e).splitlines()[0][:300],
            size,
            new_size,
            resumed_from,
            failed_at=self._failed_at,
            steps_redone=redone,
            lost_hosts=(lost,) if lost else (),
        )
        if new_size != size or self.scaling.resizes:
            self._size_to(new_size)
        return State.RUNNING

    def _resize(self) -> State:
        _, resumed_from, _ = self.job.resume_point()
        new_size = self.scaling.after_stop(self.backend, self.size)
        kind = "grow" if new_size > self.size else "restart"
        self.recoveries.begin(
            kind,
            f"task slots came back ({new_size} usable)",
            self.size,
            new_size,
            resumed_from,
            failed_at=self._failed_at,
            steps_redone=0,
        )
        self._size_to(new_size)
        return State.RUNNING


def train_with_restarts(
    backend: Any,
    rank_fn: Callable[..., Any],
    cfg: RunConfig,
    store: Store,
    *,
    max_restarts: int,
    model_bytes: Callable[[], bytes],
    lease: Lease | None = None,
    elastic: Elastic | None = None,
    probe: AttemptProbe | None = None,
) -> Trained:
    """The fit's training attempts (:class:`Controller`) with the default policies: a failed attempt
    starts again when ``restarts.should_restart`` says so, ``max_restarts`` times; with ``elastic``,
    each attempt runs on the task slots there are (after a loss the next attempt has fewer ranks, and
    while an attempt has fewer than it could, a watch asks it to stop at the next epoch end so that
    the next one grows: not counted as a restart). Every restart and resize is logged and returned as
    a :class:`Recovery`.

    Raises:
        RunInUseError: another fit took the run over meanwhile (this fit's writer ``lease`` was lost,
            or a rank found the run's lease not its own).
        JobTimeoutError: as the backend raised it; after an attempt that lost hosts, the message says so.
        NotEnoughSlotsError: elastic, and fewer than ``min_num_proc`` slots for ``elastic.timeout``.
        RankFailedError, LaunchError, RankStalledError: the backend's, when no restart is left.
        JobCancelledError: never restarted.
    """
    return Controller(
        backend,
        rank_fn,
        cfg,
        store,
        failure=FailurePolicy(max_restarts),
        scaling=ElasticScaling(elastic) if elastic is not None else FixedScaling(),
        model_bytes=model_bytes,
        lease=lease,
        probe=probe,
    ).run()
