"""The decisions the fit's controller (``ml/controller.py``) asks for, each a small object of its own
that a caller may replace: whether a failed training attempt starts again (:class:`FailurePolicy`)
and how many ranks each attempt has (:class:`FixedScaling`, or :class:`ElasticScaling` within
``min_num_proc`` / ``max_num_proc``). No Spark: the fast tests drive them alone and through the
in-process backend.
"""

import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hvd_spark._internal.common import retry
from hvd_spark._internal.common.restarts import LOST_HOST_TYPES, should_restart
from hvd_spark._internal.data.store import Store
from hvd_spark.errors import NotEnoughSlotsError, RankFailedError, RunInUseError

logger = logging.getLogger(__name__)


class FailureDecision(enum.Enum):
    """What follows a failed training attempt."""

    RESTART = "restart"  # another attempt, from the latest checkpoint or commit
    RAISE = "raise"  # the error goes to the user unchanged
    TAKEN_OVER = "taken over"  # another fit holds the run now: RunInUseError, never restarted


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """Which failed attempts start again: the restartable errors of ``restarts.should_restart``
    (a rank that failed or died, a launch that broke, a timeout or stall), ``max_restarts`` times
    in a fit; a run taken over by another fit never (``holds_run``: the attempts hold a run's writer
    lease, as a fit's do; ``hvd_spark.run``'s hold none)."""

    max_restarts: int
    holds_run: bool = True

    def decide(self, error: BaseException, restarts_so_far: int, lease_lost: bool = False) -> FailureDecision:
        """``lease_lost``: this fit's writer lease on the run was lost while the attempt ran."""
        taken = lease_lost or (isinstance(error, RankFailedError) and error.raised(RunInUseError))
        if self.holds_run and taken:
            return FailureDecision.TAKEN_OVER
        if should_restart(error, restarts_so_far, self.max_restarts):
            return FailureDecision.RESTART
        return FailureDecision.RAISE

    @staticmethod
    def lost_host(error: BaseException) -> str | None:
        """The host whose executor or network went away in ``error`` (not a failure of the rank's code)."""
        if isinstance(error, RankFailedError) and error.exc_type in LOST_HOST_TYPES and error.host:
            return error.host
        return None


@dataclasses.dataclass(frozen=True)
class Elastic:
    """Elastic training's bounds: at least ``min_num_proc`` ranks, at most ``max_num_proc`` (None: every
    task slot); fail after ``timeout`` seconds with fewer slots than ``min_num_proc``. ``poll``: seconds
    between slot counts; ``settle``: seconds a count must hold before a job is sized by it (an executor
    that just died may still be counted)."""

    min_num_proc: int
    max_num_proc: int | None
    timeout: float
    poll: float = 2.0
    settle: float = 3.0
    initial: int | None = None  # the first attempt's ranks at most (the estimator's num_proc)

    def size_for(self, slots: int) -> int:
        return slots if self.max_num_proc is None else min(slots, self.max_num_proc)


class ScalingPolicy(Protocol):
    """How many ranks each attempt has. ``backend_for`` gives the backend that runs that many."""

    resizes: bool  # whether an attempt may stop to grow (a rank result with "stopped_for_resize")

    def first_size(self, backend: Any) -> int: ...

    def backend_for(self, backend: Any, size: int) -> Any: ...

    def after_failure(self, backend: Any, size: int, lost_host: str | None, attempt: int) -> int: ...

    def after_stop(self, backend: Any, size: int) -> int: ...

    def watch(self, backend: Any, store: Store, marker: str | None, size: int) -> contextlib.AbstractContextManager: ...


class FixedScaling:
    """Every attempt on the backend's own ranks (``num_proc``, or the default layout's)."""

    resizes = False

    def first_size(self, backend: Any) -> int:
        return int(backend.num_processes())

    def backend_for(self, backend: Any, size: int) -> Any:
        return backend

    def after_failure(self, backend: Any, size: int, lost_host: str | None, attempt: int) -> int:
        return size

    def after_stop(self, backend: Any, size: int) -> int:
        return size

    def watch(self, backend: Any, store: Store, marker: str | None, size: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@dataclasses.dataclass
class ElasticScaling:
    """Each attempt on the task slots there are (``wait_for_slots``): after a loss the next attempt has
    fewer ranks, and while an attempt has fewer than it could, a :class:`GrowWatch` asks it to stop at
    the next epoch end so that the next one grows."""

    elastic: Elastic
    sleep: Callable[[float], None] = time.sleep
    resizes = True

    def first_size(self, backend: Any) -> int:
        size = wait_for_slots(backend, self.elastic, "starting", self.sleep)
        return min(size, self.elastic.initial) if self.elastic.initial else size

    def backend_for(self, backend: Any, size: int) -> Any:
        resize = getattr(backend, "with_num_proc", None)
        if resize is None:
            raise NotImplementedError(
                f"elastic training needs a backend that runs any number of ranks (with_num_proc(n)); "
                f"{type(backend).__name__} has none."
            )
        return resize(size)

    def after_failure(self, backend: Any, size: int, lost_host: str | None, attempt: int) -> int:
        new_size = wait_for_slots(backend, self.elastic, f"after the failure of attempt {attempt}", self.sleep)
        if lost_host and new_size >= size and size - 1 >= self.elastic.min_num_proc:
            # Spark may still count the lost executor (it drops one that stopped answering only after
            # spark.network.timeout): go on with one rank fewer; growing adds it back.
            new_size = size - 1
        return new_size

    def after_stop(self, backend: Any, size: int) -> int:
        return wait_for_slots(backend, self.elastic, "growing", self.sleep)

    def watch(self, backend: Any, store: Store, marker: str | None, size: int) -> contextlib.AbstractContextManager:
        return GrowWatch(backend, self.elastic, store, marker, size) if marker else contextlib.nullcontext()


def slots_of(backend: Any, holding: int = 0) -> int:
    """The task slots the next attempt may have (``holding``: those the caller's running attempt holds)."""
    count = getattr(backend, "available_slots", None)
    if count is None:
        raise NotImplementedError(
            f"elastic training needs a backend that counts its task slots (available_slots()); "
            f"{type(backend).__name__} has none."
        )
    return int(count(holding=holding)) if holding else int(count())


def wait_for_slots(backend: Any, elastic: Elastic, why: str, sleep: Callable[[float], None] = time.sleep) -> int:
    """The ranks of the next attempt: the task slots now (up to ``max_num_proc``), once at least
    ``min_num_proc`` have held for ``settle`` seconds.

    Raises:
        NotEnoughSlotsError: fewer than ``min_num_proc`` slots for ``timeout`` seconds.
        ValueError: at once, on a master whose slots never change (``local[N]``) with too few of them.
    """
    fixed = getattr(backend, "fixed_slots", lambda: None)()
    if fixed is not None and fixed < elastic.min_num_proc:
        raise ValueError(
            f"min_num_proc={elastic.min_num_proc} is more than the {fixed} task slots of this local master, which "
            "never change: lower min_num_proc, or use a cluster master."
        )
    t0 = time.monotonic()
    seen_low = None
    while True:
        slots = slots_of(backend)
        if slots >= elastic.min_num_proc:
            if elastic.settle > 0:
                sleep(elastic.settle)
                slots = min(slots, slots_of(backend))
            if slots >= elastic.min_num_proc:
                return elastic.size_for(slots)
        seen_low = slots if seen_low is None else min(seen_low, slots)
        waited = time.monotonic() - t0
        if waited >= elastic.timeout:
            raise NotEnoughSlotsError(
                f"{why}: the application has {slots} task slot(s) (at least {seen_low} over {waited:.0f}s); "
                f"elastic training needs min_num_proc={elastic.min_num_proc} "
                f"(max_num_proc={elastic.max_num_proc}) and waited elastic_timeout={elastic.timeout:g}s. "
                "Add executors, or lower min_num_proc.",
                slots=slots,
                min_num_proc=elastic.min_num_proc,
            )
        if waited == 0 or int(waited) % 30 < elastic.poll:
            logger.warning(
                "%s: %d task slot(s), fewer than min_num_proc=%d; waiting up to %.0fs more",
                why,
                slots,
                elastic.min_num_proc,
                elastic.timeout - waited,
            )
        sleep(min(elastic.poll, max(0.0, elastic.timeout - waited)))


class GrowWatch:
    """While an attempt runs on fewer ranks than it could, counts the task slots every ``poll`` seconds;
    once more exist it writes the resize marker (``cfg.commits.resize_marker``), which rank 0 reads at the next
    epoch end and all ranks then stop there together."""

    def __init__(self, backend: Any, elastic: Elastic, store: Store, marker: str, size: int):
        self.backend, self.elastic, self.store, self.marker, self.size = backend, elastic, store, marker, size
        self._stop = threading.Event()
        self.asked: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-grow-watch")

    def __enter__(self):
        if self.elastic.max_num_proc is None or self.size < self.elastic.max_num_proc:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.store.files.rm(self.marker)
        return False

    def _run(self) -> None:
        failed: set[str] = set()  # the store's errors already logged: one warning each, not one per poll
        while not self._stop.wait(self.elastic.poll):
            try:
                target = self.elastic.size_for(slots_of(self.backend, holding=self.size))
            except Exception as e:  # counting failed this time: try again at the next poll
                logger.debug("counting task slots failed: %s", e)
                continue
            if target <= self.size:
                continue
            if self._stop.is_set():
                return  # the attempt ended meanwhile: no marker for the next one
            try:
                with retry.at_most(self.elastic.poll):  # the next poll tries again
                    self.store.files.write_json(self.marker, {"size": target, "time": time.time()})
            except Exception as e:  # the store failed this time: try again at the next poll
                error = f"{type(e).__name__}: {getattr(e, 'cause', e)}"  # one warning per cause
                if error not in failed:
                    failed.add(error)
                    logger.warning(
                        "%d task slots available, but writing the resize marker %s failed (%s); training "
                        "grows once a write succeeds (tried again every %gs)",
                        target,
                        self.marker,
                        error,
                        self.elastic.poll,
                    )
                continue
            self.asked = target
            logger.info(
                "%d task slots available: training grows from %d to %d ranks at the next epoch end",
                target,
                self.size,
                target,
            )
            return
