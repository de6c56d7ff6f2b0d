"""Who runs a fit's ranks: an object of horovod.spark's ``Backend`` shape, ``run(fn, args, kwargs,
env)`` returning the ranks' results in rank order and ``num_processes()``.

:func:`fit_backend` is the one place ``fit`` gets its launcher and its rank function from: by
default a :class:`SparkBackend` (one Spark barrier stage per training attempt, through
``driver/launcher.py``) running ``rank/train.py``'s ``train``; or the object given as the
estimator's ``backend``, running its own ``rank_fn`` when it has one. :class:`InProcessBackend`
plays the ranks as plain calls in this process (no Spark), so the planning of a fit (resume,
restarts, failure reporting) runs for real in the fast tests.

Nothing here loads Spark, TensorFlow or Horovod at import.
"""

import contextvars
import copy
import dataclasses
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from hvd_spark.errors import JobCancelledError, JobTimeoutError, LaunchError, RankFailedError

logger = logging.getLogger(__name__)

# What the launcher itself raises when a job fails; a backend passes them on unchanged, so that the
# restart policy (common/restarts.py) sees what it would see from Spark.
LAUNCHER_ERRORS = (RankFailedError, LaunchError, JobTimeoutError, JobCancelledError)


class Backend:
    """horovod.spark's ``Backend``: runs a function on every rank.

    ``rank_fn`` (hvd_spark's addition; None: hvd_spark's Keras training) is what each rank runs
    in ``fit``: a backend that plays ranks without Horovod gives its own.
    """

    rank_fn: Callable[..., Any] | None = None

    def run(self, fn: Callable, args=(), kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        """Runs ``fn(*args, **kwargs)`` on every rank, with ``env`` added to each rank's environment;
        returns the results ordered by rank."""
        raise NotImplementedError

    def num_processes(self) -> int:
        """The number of ranks ``run`` starts."""
        raise NotImplementedError


# hvd_spark.run's launcher arguments that a SparkBackend passes on (horovod's SparkBackend passes its
# ``**kwargs`` to horovod.spark.run; these are the names the two share, and hvd_spark's own).
LAUNCH_ARGS = (
    "spark",
    "backend",
    "use_gloo",
    "use_mpi",
    "num_threads",
    "start_timeout",
    "timeout",
    "warm",
    "stall_timeout",
    "use_gpu",
)
# What fit and hvd_spark.run hand the launcher themselves (not for users).
_INTERNAL_ARGS = ("options", "on_event", "channel", "description")
# Launcher arguments a fit takes from a SparkBackend given as the estimator's ``backend`` (the fit has its session).
_FIT_ARGS = tuple(name for name in LAUNCH_ARGS if name != "spark")


class RankOutput:
    """Writes the ranks' output lines to a stream as ``horovod.spark.run`` does: ``[<rank>]<stdout>:<line>``,
    with ``time.asctime()`` before it when ``timestamp`` (horovod's ``prefix_output_with_timestamp``).

    The tag names the stream written to: a rank's stdout and stderr reach the driver as one stream of
    lines (the task reads the rank's process through one pipe), so they cannot be told apart here.
    Called from the launcher's service threads: one line at a time, flushed.
    """

    def __init__(self, stream: Any, tag: str, timestamp: bool):
        self.stream, self.tag, self.timestamp = stream, tag, timestamp
        self._lock = threading.Lock()
        self._failed = False

    def __call__(self, rank: int, line: str) -> None:
        stamp = time.asctime() if self.timestamp else ""
        text = f"{stamp}[{rank}]<{self.tag}>:{line}\n"
        with self._lock:
            try:
                self.stream.write(text)
                flush = getattr(self.stream, "flush", None)
                if callable(flush):
                    flush()
            except Exception as e:  # noqa: BLE001 - a broken stream must not break the job
                if not self._failed:
                    self._failed = True
                    logger.warning(
                        "writing the ranks' output to %r failed (%s); it goes to the log instead", self.stream, e
                    )
                logging.getLogger("hvd_spark.rank").info("[rank %s] %s", rank, line)


class SparkBackend(Backend):
    """Ranks as Spark barrier tasks (:func:`hvd_spark.run`'s launcher, warm ranks included), with
    horovod.spark's ``SparkBackend`` constructor: ``from hvd_spark import SparkBackend`` stands in for
    ``from horovod.spark.common.backend import SparkBackend``.

    Given as the estimator's ``backend``, a fit trains exactly as with the default backend (hvd_spark's
    own rank function, warm ranks, progress, the stall watchdog) on ``num_proc`` ranks, with the
    arguments below applied.

    Args:
        num_proc: ranks; default (None) the application's task slots (horovod: ``spark.default.parallelism``).
        env: environment variables added to every rank's, as :func:`hvd_spark.run`'s ``env`` (horovod:
            the ranks' whole environment, default ``os.environ``, without ``CUDA_VISIBLE_DEVICES``; here a
            ``CUDA_VISIBLE_DEVICES`` in it wins over the GPUs Spark assigned). In a fit they win over
            ``backend_env``.
        stdout: a file-like object (``write``) that receives the ranks' output lines, as
            ``[<rank>]<stdout>:<line>``; default None: the ``hvd_spark.rank`` logger.
        stderr: as ``stdout`` when ``stdout`` is None. A rank's stdout and stderr reach the driver
            merged into one stream of lines, so when both are given every line goes to ``stdout``
            (a warning says so).
        prefix_output_with_timestamp: put ``time.asctime()`` before each line written to ``stdout`` /
            ``stderr``, as horovod does (default False).
        verbose: as :func:`hvd_spark.run`'s ``verbose`` when ``run`` is called directly (default 1); in a
            fit the estimator's ``verbose`` decides.
        nics: accepted and ignored with a warning: each rank's Gloo interface is the one that carries
            its Spark task's address.
        extra_mpi_args: refused unless empty: hvd_spark starts ``mpirun`` (``use_mpi=True``) with its
            own arguments.
        executable: refused unless None or ``sys.executable``: ranks run in the executors' Python
            (``spark.pyspark.python`` / ``PYSPARK_PYTHON``).
        **kwargs: :func:`hvd_spark.run`'s launcher arguments (horovod.spark.run's ``start_timeout``,
            ``use_gloo``, ``use_mpi``, and ``spark``, ``backend``, ``num_threads``, ``timeout``, ``warm``,
            ``stall_timeout``, ``use_gpu``). In a fit, one also set on the estimator (``start_timeout``,
            ``stall_timeout``, ``use_gpu``) must be equal there.

    Raises:
        TypeError: an argument horovod.spark.run does not have, or of the wrong type.
        ValueError: ``num_proc`` < 1; ``extra_mpi_args`` or another ``executable``.

    Example:
        >>> backend = SparkBackend(num_proc=2, stdout=sys.stdout, prefix_output_with_timestamp=True)
        >>> KerasEstimator(backend=backend, store=store, model=model, ...).fit(df)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_proc: int | None = None,
        env: dict[str, str] | None = None,
        *,
        stdout: Any = None,
        stderr: Any = None,
        prefix_output_with_timestamp: bool = False,
        verbose: int = 1,
        nics: Any = None,
        extra_mpi_args: str | None = None,
        executable: str | None = None,
        **kwargs: Any,
    ):
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise ValueError(f"num_proc must be a positive integer or None. Received: num_proc={num_proc!r}.")
        unknown = sorted(set(kwargs) - set(LAUNCH_ARGS) - set(_INTERNAL_ARGS))
        if unknown:
            raise TypeError(
                f"SparkBackend got unexpected argument(s) {', '.join(unknown)}. It takes horovod.spark.run's "
                f"arguments (num_proc, env, stdout, stderr, prefix_output_with_timestamp, verbose, nics, "
                f"extra_mpi_args, executable) and hvd_spark.run's: {', '.join(LAUNCH_ARGS)}."
            )
        self._num_proc = num_proc
        self._env = _rank_env(env)
        self._kwargs = kwargs
        self._verbose = _verbose(verbose)
        self._output = _output(stdout, stderr, prefix_output_with_timestamp)
        if extra_mpi_args:
            raise ValueError(
                "extra_mpi_args is not supported: hvd_spark starts mpirun itself (use_mpi=True or backend='mpi') "
                f"with the arguments it needs. Received: extra_mpi_args={extra_mpi_args!r}. Remove it."
            )
        if executable is not None and executable != sys.executable:
            raise ValueError(
                "executable is not supported: the ranks run in the Spark executors' Python, set by "
                f"spark.pyspark.python or PYSPARK_PYTHON. Received: executable={executable!r}. Set one of those "
                "instead, and remove executable."
            )
        if nics:
            logger.warning(
                "SparkBackend: nics=%r is ignored: each rank's Gloo interface is the one that carries its Spark "
                "task's address",
                nics,
            )

    def _replace(self, **kwargs: Any) -> "SparkBackend":
        """This backend with other launcher arguments (its ``num_proc``, ``env`` and output kept)."""
        other = copy.copy(self)
        other._kwargs = kwargs
        return other

    def run(self, fn: Callable, args=(), kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        from hvd_spark._internal.common.logs import ensure_visible
        from hvd_spark._internal.driver.launcher import launch

        full_env = dict(self._env or {}, **(env or {})) or None
        launch_kwargs = dict(self._kwargs)
        options = launch_kwargs.get("options")
        if options is None:
            ensure_visible(self._verbose)  # a direct call, as hvd_spark.run (a fit has set up its logging)
        if options is not None and full_env:  # resolved options carry the environment
            launch_kwargs["options"] = dataclasses.replace(options, env=dict(options.env or {}, **full_env))
        if self._output is not None:
            launch_kwargs["on_log"] = self._output
        return launch(fn, args, kwargs, num_proc=self._num_proc, env=full_env, **launch_kwargs)

    def num_processes(self) -> int:
        options = self._kwargs.get("options")
        if options is not None:
            return int(options.num_proc)
        if self._num_proc is not None:
            return self._num_proc
        from hvd_spark._internal.driver.options import resolve_launch_options
        from hvd_spark._internal.driver.sessions import active_session

        spark = active_session(self._kwargs.get("spark"))
        return resolve_launch_options(spark, num_proc=None).num_proc

    def available_slots(self, holding: int = 0) -> int:
        """The barrier task slots of the executors registered now that no other hvd_spark job of this
        driver holds (elastic training sizes its attempts by them; ``holding``: the slots the caller's
        own running attempt holds, counted as its own). A classic session only: Spark Connect does not
        show its executors to the client."""
        return max(0, self._registered_slots() - max(0, self._held_slots() - holding))

    def _held_slots(self) -> int:
        """The slots this driver's hvd_spark jobs hold now (``driver/slots.py``'s pool): two elastic fits
        side by side each size themselves by what the other leaves."""
        from hvd_spark._internal.common.sessions import application_id
        from hvd_spark._internal.driver.sessions import active_session
        from hvd_spark._internal.driver.slots import SLOTS

        return SLOTS.held(application_id(active_session(self._kwargs.get("spark"))))

    def _registered_slots(self) -> int:
        from hvd_spark._internal.common import internals
        from hvd_spark._internal.common.topology import task_slots
        from hvd_spark._internal.driver.sessions import active_session

        spark = active_session(self._kwargs.get("spark"))
        sc = getattr(spark, "sparkContext", None)
        if sc is None or type(spark).__module__.startswith("pyspark.sql.connect"):
            raise NotImplementedError(
                "elastic training counts the executors' task slots, which a Spark Connect client cannot see; "
                "use a classic session (or fixed num_proc with max_restarts)."
            )
        from hvd_spark._internal.common.topology import task_cpus

        if sc.master.strip().startswith("local") and not sc.master.strip().startswith("local-cluster"):
            # local[N]: one JVM whose slots never change
            return task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=task_cpus(sc.getConf()))
        return internals.spark_executor_slots(sc)[1]  # executors come and go, local-cluster's too

    def fixed_slots(self) -> int | None:
        """The task slots of a ``local[N]`` master, which never change; None on a cluster master."""
        from hvd_spark._internal.driver.sessions import active_session

        spark = active_session(self._kwargs.get("spark"))
        sc = getattr(spark, "sparkContext", None)
        master = (
            sc.master.strip() if sc is not None and not type(spark).__module__.startswith("pyspark.sql.connect") else ""
        )
        if master.startswith("local") and not master.startswith("local-cluster"):
            return self.available_slots()
        return None

    def with_num_proc(self, num_proc: int) -> "SparkBackend":
        """The same backend running ``num_proc`` ranks."""
        kwargs = dict(self._kwargs)
        options = kwargs.get("options")
        if options is not None:
            kwargs["options"] = dataclasses.replace(options, num_proc=num_proc, slots=max(options.slots, num_proc))
        other = self._replace(**kwargs)
        other._num_proc = num_proc
        return other

    def fit_launch_args(self) -> dict[str, Any]:
        """The launcher arguments given to this backend that a fit applies (not ``spark``: a fit runs
        on its DataFrame's session), with the ranks' environment as ``env``."""
        given = {k: self._kwargs[k] for k in _FIT_ARGS if self._kwargs.get(k) is not None}
        if self._env:
            given["env"] = dict(self._env)
        return given


def _rank_env(env: Any) -> dict[str, str] | None:
    """A SparkBackend's ``env``, checked: names and values as strings."""
    if env is None:
        return None
    if not hasattr(env, "items"):
        raise TypeError(f"env must be a dict of environment variable names to values. Received: {type(env).__name__}.")
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"env must map str to str. Received: {bad!r}.")
    return dict(env) or None


def _verbose(verbose: Any) -> int:
    if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2. Received: verbose={verbose!r}.")
    return verbose


def _output(stdout: Any, stderr: Any, timestamp: Any) -> RankOutput | None:
    """Where a SparkBackend writes the ranks' output lines: ``stdout``, else ``stderr``, else None
    (the ``hvd_spark.rank`` logger)."""
    if not isinstance(timestamp, bool):
        raise TypeError(
            f"prefix_output_with_timestamp must be True or False. Received: prefix_output_with_timestamp={timestamp!r}."
        )
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(
                f"{name} must be a file-like object with write(), or None. Received: {type(stream).__name__}."
            )
    if stdout is not None and stderr is not None and stderr is not stdout:
        logger.warning(
            "SparkBackend: the ranks' stderr lines go to stdout, not to stderr: a rank's stdout and stderr reach "
            "the driver merged into one stream of lines"
        )
    if stdout is not None:
        return RankOutput(stdout, "stdout", timestamp)
    if stderr is not None:
        return RankOutput(stderr, "stderr", timestamp)
    return None


@dataclasses.dataclass(frozen=True)
class RankContext:
    """The rank an :class:`InProcessBackend` is playing: what ``hvd.rank()``, ``hvd.size()`` and the
    rank's environment would be."""

    rank: int
    size: int
    env: dict[str, str]


_RANK: contextvars.ContextVar[RankContext | None] = contextvars.ContextVar("hvd_spark_in_process_rank", default=None)


def in_process_rank() -> RankContext:
    """The rank being played, inside a function that :class:`InProcessBackend` runs."""
    ctx = _RANK.get()
    if ctx is None:
        raise RuntimeError("in_process_rank() is only known inside a function run by InProcessBackend.run.")
    return ctx


class InProcessBackend(Backend):
    """Ranks played by this process, one after the other: rank 0's call, then rank 1's, ... No Spark
    and no Horovod; :func:`in_process_rank` tells a call which rank it plays.

    Failures look as the launcher reports them: an exception from a rank's call becomes a
    :class:`hvd_spark.RankFailedError` naming the rank and the exception's qualified type, and the
    ranks after it do not run; a launcher error raised by the call (``RankFailedError``,
    ``LaunchError``, ``JobTimeoutError`` / ``RankStalledError``, ``JobCancelledError``) passes
    unchanged, so a test plays a stalled or cancelled job by raising one.

    Args:
        num_proc: ranks played (default 1).
        rank_fn: what each rank runs in ``fit`` instead of hvd_spark's Keras training (which needs
            Horovod): a function of the run configuration, like ``rank/train.py``'s ``train``.
        env: environment of every rank, seen through :func:`in_process_rank` (``os.environ`` is
            left alone).
    """

    def __init__(
        self, num_proc: int = 1, *, rank_fn: Callable[..., Any] | None = None, env: dict[str, str] | None = None
    ):
        if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
            raise ValueError(f"num_proc must be a positive integer. Received: num_proc={num_proc!r}.")
        if rank_fn is not None and not callable(rank_fn):
            raise TypeError(f"rank_fn must be callable. Received: {type(rank_fn).__name__}.")
        self._num_proc = num_proc
        self.rank_fn = rank_fn
        self._env = dict(env or {})
        self.calls = 0  # run() calls so far: one per training attempt of a fit
        self.sizes: list[int] = []  # the ranks of each run() call
        self.slots = num_proc  # what available_slots() says: a test sets it to play lost or returning slots

    def run(self, fn: Callable, args=(), kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        self.calls += 1
        self.sizes.append(self._num_proc)
        results = []
        for rank in range(self._num_proc):
            token = _RANK.set(RankContext(rank, self._num_proc, dict(self._env, **(env or {}))))
            try:
                results.append(fn(*args, **(kwargs or {})))
            except LAUNCHER_ERRORS:
                raise
            except Exception as e:
                kind = f"{type(e).__module__}.{type(e).__qualname__}".replace("builtins.", "")
                raise RankFailedError(rank, kind, str(e), traceback.format_exc()) from e
            finally:
                _RANK.reset(token)
        return results

    def num_processes(self) -> int:
        return self._num_proc

    def available_slots(self, holding: int = 0) -> int:
        return int(self.slots() if callable(self.slots) else self.slots)

    def with_num_proc(self, num_proc: int) -> "InProcessBackend":
        """This backend, now playing ``num_proc`` ranks (its counters go on)."""
        self._num_proc = num_proc
        return self


def rank_function(backend: Any, default: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """What each rank runs in ``fit``: the backend's ``rank_fn`` when it has one, else ``default``
    (the framework's training: ``ml/framework.py``), else hvd_spark's Keras training
    (``rank/train.py``; imported only then: it loads Keras)."""
    fn = getattr(backend, "rank_fn", None)
    if fn is not None:
        return fn
    if default is not None:
        return default
    from hvd_spark._internal.rank.train import train

    return train


def fit_backend(
    user_backend: Any, default_rank_fn: Callable[..., Any] | None = None, **launch_kwargs: Any
) -> tuple[Any, Callable[..., Any]]:
    """The backend and rank function of one fit: the estimator's backend object, or a
    :class:`SparkBackend` over ``launch_kwargs`` (the fit's resolved ``options``, ``spark``,
    ``on_event``, ``channel``, ``description``). A :class:`SparkBackend` given as the estimator's
    backend gets the same ``launch_kwargs`` (its own launcher arguments are in the ``options``, see
    :func:`fit_launch_args`), keeping its ``num_proc``, ``env`` and output."""
    if user_backend is None:
        backend = SparkBackend(**launch_kwargs)
    elif isinstance(user_backend, SparkBackend):
        backend = user_backend._replace(**launch_kwargs)
    else:
        backend = user_backend
    return backend, rank_function(backend, default_rank_fn)


def launches_with_spark(user_backend: Any) -> bool:
    """Whether a fit's ranks start through hvd_spark's launcher (warm servers, slot checks): no
    backend object, or a :class:`SparkBackend`."""
    return user_backend is None or isinstance(user_backend, SparkBackend)


def fit_launch_args(user_backend: Any, fit_args: dict[str, Any]) -> dict[str, Any]:
    """``resolve_launch_options``' arguments of a fit: ``fit_args`` (from the estimator's params) with
    those given to a :class:`SparkBackend` used as its backend. Its ``env`` goes on top of the fit's;
    a controller given to it (``use_mpi``, ``use_gloo``, ``backend``) replaces the default ``backend``
    param; any other argument set on both must be equal."""
    if not isinstance(user_backend, SparkBackend):
        return fit_args
    merged = dict(fit_args)
    given = user_backend.fit_launch_args()
    if any(k in given for k in ("backend", "use_gloo", "use_mpi")):
        merged["backend"] = None  # the estimator's backend param is its default: the object replaced it
    for name, value in given.items():
        if name == "env":
            merged["env"] = dict(merged.get("env") or {}, **value)
        elif name in ("backend", "use_gloo", "use_mpi"):
            merged[name] = value
        elif merged.get(name) is not None and merged[name] != value:
            raise ValueError(
                f"{name} is set both on the estimator ({merged[name]!r}) and on its SparkBackend ({value!r}). "
                f"Set it in one place."
            )
        else:
            merged[name] = value
    return merged
