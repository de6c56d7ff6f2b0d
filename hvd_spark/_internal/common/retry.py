"""The one retry policy of hvd_spark's store operations (and of a rank's reads of the training data).

Object stores and network filesystems fail for a moment as a matter of course: a server restarts,
a connection is reset, a request times out, the service answers 5xx or asks to slow down. Each
operation on a store that a fit depends on runs through :func:`call`: a *transient* error
(:func:`is_transient`) is retried with exponential backoff (0.5 s, doubling, at most 15 s apart)
for as long as the retry window lasts (the ``store_retry_window`` setting, 120 s by default);
past it, :class:`hvd_spark.errors.StoreUnavailableError` names the store, the operation and the
cause in its first line. Any other error (a missing file, a permission, a full disk) is raised at
once, unchanged.

Calls nest (a write that creates its folder first): only the outermost call retries, so one
operation never waits more than one window. Pure Python: no Spark, no fsspec, no boto at import
(errors of those libraries are recognised by their class names).
"""

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from hvd_spark.errors import StoreUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY = 0.5  # seconds before the first retry; doubled after each, up to MAX_DELAY
MAX_DELAY = 15.0

# Errno values of a network that fails for a moment, and of s3fs's translations of S3's
# "slow down" / "service unavailable" (EBUSY) and "internal error" (EREMOTEIO) answers.
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", 121),
}
_EBUSY_FROM_SERVER = errno.EBUSY  # transient only when a server said it (a ClientError is its cause)

# Classes of botocore, aiohttp, urllib3 and fsspec that mean "the connection failed or timed out"
# (matched by name along the class's bases, so that none of them is imported here).
_TRANSIENT_CLASSES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ProxyConnectionError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientOSError",
    "ClientPayloadError",
    "IncompleteRead",
    "ResponseParserError",
    "FSTimeoutError",
    "ProtocolError",
    "NewConnectionError",
    "MaxRetryError",
}
# S3 error codes that ask the client to come back later.
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
    "OperationAborted",
}

_nesting = threading.local()  # depth: calls in progress in this thread; cap: at_most's limit
_window: float | None = None  # this process's window when set by set_window (a rank: the driver's)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``raise ... from``); an error raised while another
    was handled only when it is a bare wrapper (an ``OSError`` without an errno: fsspec's, pyarrow's),
    so that a real error raised in an ``except`` block is not taken for the one it handled."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen and len(seen) < 10:
        seen.add(id(e))
        yield e
        if e.__cause__ is not None:
            e = e.__cause__
        elif type(e) is OSError and e.errno is None and not e.__suppress_context__:
            e = e.__context__
        else:
            e = None


def _server_says_later(e: BaseException) -> bool:
    """A botocore ``ClientError`` (or one like it) whose answer is 5xx, 429 or a throttling code."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return False
    code = str((response.get("Error") or {}).get("Code", ""))
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in _TRANSIENT_CODES or (isinstance(status, int) and (status >= 500 or status == 429))


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is one that may pass if tried again: a
    refused, reset or timed-out connection, a 5xx answer, throttling."""
    if isinstance(error, StoreUnavailableError):
        return False  # a nested operation's window already ran out
    for e in _chain(error):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_CLASSES for c in type(e).__mro__):
            return True
        if _server_says_later(e):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if isinstance(e, OSError) and e.errno == _EBUSY_FROM_SERVER and e.__cause__ is not None:
            return _server_says_later(e.__cause__)
    return False


def window() -> float:
    """Seconds an operation is retried: :func:`set_window`'s value in this process, else the
    ``store_retry_window`` setting."""
    if _window is not None:
        return _window
    from hvd_spark._internal.common import settings

    return float(settings.STORE_RETRY_WINDOW.get())


def set_window(seconds: float | None) -> None:
    """Fixes this process's window (a rank takes the driver's, from its run configuration)."""
    global _window
    _window = None if seconds is None else float(seconds)


@contextlib.contextmanager
def at_most(seconds: float) -> Iterator[None]:
    """Store operations of this thread inside the block are retried for ``seconds`` at most (a lease's
    heartbeat, retried by the next one anyway; a clean-up at the end of a failed fit, which must not
    keep the user's error waiting for a whole window)."""
    previous = getattr(_nesting, "cap", None)
    _nesting.cap = seconds if previous is None else min(previous, seconds)
    try:
        yield
    finally:
        _nesting.cap = previous


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}" if text else type(error).__name__


def call(
    store: str,
    operation: str,
    fn: Callable[[], T],
    *,
    seconds: float | None = None,
    on_retry: Callable[[BaseException], Any] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``fn()``, retried on transient errors for ``seconds`` (None: :func:`window`).

    Args:
        store: the store's URL (without credentials), for messages.
        operation: what is done, e.g. ``"listing runs/r1/checkpoints"``.
        on_retry: called with the error before each retry (a reader drops its open file).

    Raises:
        StoreUnavailableError: the errors were transient but did not pass within the window.
        Exception: any other error of ``fn``, at once.
    """
    if getattr(_nesting, "depth", 0):
        return fn()  # the outermost call retries the whole operation
    limit = window() if seconds is None else seconds
    cap = getattr(_nesting, "cap", None)
    if cap is not None:
        limit = min(limit, cap)
    started, delay, tries = clock(), FIRST_DELAY, 0
    with contextlib.ExitStack() as waiting:
        while True:
            result, error = _try(fn)
            if error is None:
                if tries:
                    logger.warning(
                        "store %s: %s succeeded after %d retries (%.1fs)", store, operation, tries, clock() - started
                    )
                return cast(T, result)
            if not is_transient(error):
                raise error
            waited = clock() - started
            if waited + delay > limit:
                raise StoreUnavailableError(store, operation, one_line(error), waited, tries + 1, limit) from error
            if tries == 0:
                logger.warning(
                    "store %s: %s failed (%s); retrying for up to %gs", store, operation, one_line(error), limit
                )
                from hvd_spark._internal.common.events import busy

                # A rank waiting for the store is not stalled (the stall watchdog); past the window it fails.
                waiting.enter_context(busy(f"waiting for the store ({operation})"))
            tries += 1
            if on_retry is not None:
                with contextlib.suppress(Exception):  # best effort: the retry itself says what fails
                    on_retry(error)
            sleep(delay)
            delay = min(2 * delay, MAX_DELAY)


def _try(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``fn()`` as (result, None), or (None, error); nested calls inside it do not retry."""
    _nesting.depth = getattr(_nesting, "depth", 0) + 1
    try:
        return fn(), None
    except Exception as e:
        return None, e
    finally:
        _nesting.depth -= 1
