"""From a rank's process to the driver service (on the driver, or in the first barrier task on Spark
Connect): progress events (the estimator's callbacks) and the
progress ticks that the stall watchdog reads."""

import os
import threading

from hvd_spark._internal.common import settings
from hvd_spark._internal.driver.service import KIND, Kind

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
                from hvd_spark._internal.driver.service import TaskClient

                _client = TaskClient(addr, token, {"role": "rank", "rank": rank}, timeout=10)
            except OSError:
                return False
        message.setdefault("rank", rank)
        return _client.send(message)


class _Progress:
    """A rank's progress counter, sent to the driver's stall watchdog by a background thread.

    :meth:`tick` only counts and notes where the rank is (no I/O: it runs on every training step);
    the thread sends the count when it changed, at most every ``PROGRESS_INTERVAL`` seconds. A
    rank that stops (a hang, SIGSTOP, a collective its peers never join) stops counting, and the
    driver sees its count stand still."""

    def __init__(self):
        self.count = 0
        self.where = ""
        self._sent = -1
        self._thread: threading.Thread | None = None

    def tick(self, where: str | None) -> None:
        self.count += 1
        if where is not None:
            self.where = where
        if self._thread is None and os.environ.get(settings.ENV_DRIVER_ADDR):  # in an hvd_spark job
            self._thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-progress")
            self._thread.start()

    def _send(self) -> None:
        count = self.count
        if count != self._sent and _send_raw({KIND: Kind.PROGRESS, "count": count, "where": self.where}):
            self._sent = count

    def _run(self) -> None:
        stop = threading.Event()
        while True:
            self._send()
            stop.wait(settings.PROGRESS_INTERVAL)


_progress = _Progress()


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
