"""From a rank's process to the driver service (on the driver, or in the first barrier task on Spark
Connect): progress events (the estimator's callbacks) and the
progress ticks that the stall watchdog reads."""

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.service import KIND, Kind

logger = logging.getLogger(__name__)

_client = None
_lock = threading.Lock()


def send_event(payload: dict) -> bool:
    """Sends ``payload`` (JSON-serializable) to the driver's ``on_event`` callback.

    Returns False, doing nothing, outside an hvd_spark job or when the driver is unreachable;
    progress must never fail training.
    """
    rank = int(os.environ.get(settings.ENV_RANK, "-1"))
    return _send_raw({KIND: Kind.EVENT, "rank": rank, "payload": payload})


def _send_raw(message: dict) -> bool:
    """Sends one message to the driver service on this rank's own connection (made on first use)."""
    global _client
    addr = os.environ.get(settings.ENV_DRIVER_ADDR)
    token = os.environ.get(settings.ENV_JOB_TOKEN)
    if not addr or not token:
        return False
    rank = int(os.environ.get(settings.ENV_RANK, "-1"))
    with _lock:
        if _client is None:
            try:
                from hvd_spark._internal.common.service import TaskClient

                _client = TaskClient(addr, token, {"role": "rank", "rank": rank}, timeout=10)
            except OSError:
                return False
        message.setdefault("rank", rank)
        return _client.send(message)


class _Progress:
    """A rank's progress counter, sent to the driver's stall watchdog by a background thread.

    Two numbers: ``count`` moves on every tick (:func:`mark_progress` and the ticks of a
    :func:`busy` block) and tells the watchdog that the rank is alive; ``marks`` moves only on
    :func:`mark_progress` and says how far along its steps the rank is (a busy block's ticks come
    with time, not with steps, so they would make ranks that do the same steps look apart). The
    stall report puts the rank with the fewest marks first.

    :meth:`tick` only counts and notes where the rank is (no I/O: it runs on every training step);
    the thread sends both numbers when the count changed, at most every ``PROGRESS_INTERVAL``
    seconds. A rank that stops (a hang, SIGSTOP, a collective its peers never join) stops counting,
    and the driver sees its count stand still."""

    def __init__(self):
        self.count = 0
        self.marks = 0
        self.where = ""
        self._sent = -1
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def tick(self, where: str | None) -> None:
        self.count += 1
        self.marks += 1
        if where is not None:
            self.where = where
        if self._thread is None:
            self._start_sender()

    def keep_alive(self, where: str) -> None:
        """A tick that moves ``count`` only (a :func:`busy` block: alive, no step further)."""
        self.count += 1
        self.where = where
        if self._thread is None:
            self._start_sender()

    def _start_sender(self) -> None:
        if not os.environ.get(settings.ENV_DRIVER_ADDR):  # outside an hvd_spark job: count only
            return
        with self._start_lock:  # a busy block's thread and the training loop may tick at once
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-progress")
                self._thread.start()

    def _send(self) -> None:
        count = self.count
        if count == self._sent:
            return
        if _send_raw({KIND: Kind.PROGRESS, "count": count, "marks": self.marks, "where": self.where}):
            self._sent = count

    def _run(self) -> None:
        stop = threading.Event()
        while True:
            self._send()
            stop.wait(settings.PROGRESS_INTERVAL)


_progress = _Progress()


def keep_alive(where: str) -> None:
    """Tells the stall watchdog this rank is alive without counting a step (validation batches:
    ranks evaluate different numbers of them, so they must not move one rank ahead of another in
    the stall report's order)."""
    _progress.keep_alive(where)


def mark_progress(where: str | None = None) -> None:
    """Tells hvd_spark's stall watchdog that this rank is making progress (see ``stall_timeout``).

    The estimator's ranks call it on every step; a function run with :func:`hvd_spark.run` calls it
    itself (once per step or loop iteration) when the job has a ``stall_timeout``. It costs about
    150 ns and sends nothing outside an hvd_spark job.

    Args:
        where: a short description of what the rank is doing (``"epoch 3 step 120"``), quoted in
            the stall report.
    """
    _progress.tick(where)


BUSY_INTERVAL = settings.PROGRESS_INTERVAL  # seconds between a busy block's ticks

_busy_lock = threading.Lock()
_busy_blocks: list["_Busy"] = []  # the open busy blocks of this process, in the order they opened


class _Busy:
    """One open :func:`busy` block: its place, its deadline and the thread that ticks for it."""

    def __init__(self, where: str, limit: float | None):
        self.where = where
        self.deadline = None if limit is None else time.monotonic() + limit
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-busy")

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _run(self) -> None:
        while not self.stop.wait(BUSY_INTERVAL):
            if self.expired():
                logger.debug("busy block %r passed its limit: no more ticks for it", self.where)
                return
            with _busy_lock:
                if self.stop.is_set():  # closed while this thread waited for the lock
                    return
                # The latest opened block within its limit names the place (nested blocks tick
                # each for themselves, all with the same place).
                where = next((b.where for b in reversed(_busy_blocks) if not b.expired()), self.where)
                _progress.keep_alive(where)


@contextlib.contextmanager
def busy(where: str, limit: float | None = None) -> Iterator[None]:
    """Counts a long operation that makes no steps (a checkpoint upload, a first step that traces
    for minutes) as progress for the stall watchdog (``stall_timeout``).

    On entry it ticks once, then a daemon thread ticks every ``BUSY_INTERVAL`` seconds (one
    second) while the block runs, noting ``where`` as the rank's place. The ticks keep the rank
    alive but do not count as steps: the stall report's order (the rank with the fewest
    :func:`mark_progress` calls first) is not changed by them. After ``limit`` seconds (None: no
    limit) the thread stops ticking, so an operation that truly hangs is still caught
    ``stall_timeout`` seconds later. The thread stops when the block ends, by an exception too:
    no tick after the ``with`` statement, and the place becomes ``"after <where>"`` until the next
    tick names another. Blocks nest (in one thread or several): each ticks for its own limit, and
    the latest opened one within its limit names the place.

    Outside an hvd_spark job it ticks this process's counter and sends nothing; the cost is one
    thread per block.

    Args:
        where: what the rank is doing (``"uploading the checkpoint of epoch 3"``), quoted in the
            stall report.
        limit: seconds after which the block no longer counts as progress; None: for as long as it
            runs.
    """
    if limit is not None and (isinstance(limit, bool) or not limit > 0):
        raise ValueError(f"limit must be None or a number of seconds greater than 0. Received: {limit!r}.")
    block = _Busy(str(where), None if limit is None else float(limit))
    with _busy_lock:
        _busy_blocks.append(block)
        _progress.keep_alive(block.where)
    block.thread.start()
    try:
        yield
    finally:
        with _busy_lock:
            block.stop.set()
            _busy_blocks.remove(block)
            if _progress.where == block.where:  # the place is no longer this block's
                _progress.where = _busy_blocks[-1].where if _busy_blocks else f"after {block.where}"
        block.thread.join()


def report_init_when_done(poll: float = 0.1) -> None:
    """Starts a thread that tells the driver once this rank's ``hvd.init()`` has returned (for any
    framework's Horovod), so that rank 0's task closes Gloo's rendezvous server once every rank is
    past it. It polls Horovod's ``is_initialized`` (set when init is complete, process sets given to
    init included) and stops after reporting. Outside an hvd_spark job it does nothing."""
    if not os.environ.get(settings.ENV_DRIVER_ADDR):
        return
    from hvd_spark._internal.common.internals import horovod_initialized

    def watch() -> None:
        while not horovod_initialized():
            threading.Event().wait(poll)
        _send_raw({KIND: Kind.INITIALIZED})

    threading.Thread(target=watch, daemon=True, name="hvd_spark-init-watch").start()


def report_initialized() -> None:
    """Tells the driver that this rank's collective is up (a torch rank's ``init_process_group``
    returned): what :func:`report_init_when_done` says of ``hvd.init()``. Outside a job: nothing."""
    if os.environ.get(settings.ENV_DRIVER_ADDR):
        _send_raw({KIND: Kind.INITIALIZED})
