"""SIGTERM on the driver ends a fit or a ``hvd_spark.run`` the way Ctrl-C does, then the process.

YARN, Kubernetes and spot reclaims send SIGTERM first (SIGKILL follows after a grace period). Its
default disposition ends the process at once: the ranks stop (their tasks lose the driver), but the
run's lease and the data's reading lease stay in the store, and the next driver is refused until
they expire. While a fit or a run is in progress on the main thread, :func:`sigterm_as_cancel`
turns SIGTERM into :class:`Terminated`, a ``KeyboardInterrupt``: the cancel path runs (the barrier
stage cancelled and its ranks waited for, ``driver/classic.py``; the leases released and the fit's
temporary data removed by their ``finally`` blocks), and then the process ends with SIGTERM's own
default disposition (exit status 143, ``-15`` for a parent's ``Popen``), as it would have without
hvd_spark.

A SIGTERM handler the program installed (or SIG_IGN) is left alone: hvd_spark installs its own only
over the default one, and only on the main thread (Python runs signal handlers there); the previous
one is back when the fit or run returns. A second SIGTERM while the clean-up runs is logged and
ignored; SIGKILL ends it.
"""

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the driver during a fit or a run: it stops as a cancel (Ctrl-C) does, then the
    process exits with SIGTERM's status."""


@contextlib.contextmanager
def sigterm_as_cancel(what: str) -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread; after the block
    (its clean-up done), the process ends by SIGTERM's default disposition. Does nothing off the main
    thread, or when SIGTERM already has a handler (the program's own, SIG_IGN, or an outer block's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return
    received: list[bool] = []

    def on_sigterm(signum, frame):
        if received:
            logger.warning("SIGTERM again: %s is already stopping (its ranks, then its leases)", what)
            return
        received.append(True)
        logger.warning("SIGTERM: stopping %s as a cancel (ranks stopped, leases released), then exiting", what)
        raise Terminated(f"{what} stopped by SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            _exit_by_sigterm(what)


def _exit_by_sigterm(what: str) -> None:
    logger.warning("%s stopped; exiting as SIGTERM asked", what)
    for handler in logging.getLogger().handlers + logging.getLogger("hvd_spark").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.kill(os.getpid(), signal.SIGTERM)  # the default disposition: the process ends here
    raise SystemExit(128 + signal.SIGTERM)  # (only if SIGTERM is blocked in every thread)


def ends_on_sigterm(what: str) -> Callable[[F], F]:
    """A decorator: the function runs under :func:`sigterm_as_cancel`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with sigterm_as_cancel(what):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]

    return wrap
