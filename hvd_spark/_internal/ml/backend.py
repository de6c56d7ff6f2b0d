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
import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

from hvd_spark.errors import JobCancelledError, JobTimeoutError, LaunchError, RankFailedError

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


class SparkBackend(Backend):
    """Ranks as Spark barrier tasks (:func:`hvd_spark.run`'s launcher), as horovod.spark's
    ``SparkBackend(num_proc=None, env=None, **kwargs)``.

    Args:
        num_proc: ranks; default the application's task slots.
        env: environment variables for every rank (``run``'s ``env`` adds to them).
        **kwargs: further arguments of the launcher (those of :func:`hvd_spark.run`, e.g. ``spark``,
            ``start_timeout``; ``fit`` passes its resolved ``options``, ``on_event`` and ``channel``).
    """

    def __init__(self, num_proc: int | None = None, env: dict[str, str] | None = None, **kwargs: Any):
        self._num_proc = num_proc
        self._env = dict(env) if env else None
        self._kwargs = kwargs

    def run(self, fn: Callable, args=(), kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        from hvd_spark._internal.driver.launcher import launch

        full_env = dict(self._env or {}, **(env or {})) or None
        launch_kwargs = dict(self._kwargs)
        options = launch_kwargs.get("options")
        if options is not None and full_env:  # resolved options carry the environment
            launch_kwargs["options"] = dataclasses.replace(options, env=dict(options.env or {}, **full_env))
        return launch(fn, args, kwargs, num_proc=self._num_proc, env=full_env, **launch_kwargs)

    def num_processes(self) -> int:
        options = self._kwargs.get("options")
        if options is not None:
            return int(options.num_proc)
        if self._num_proc is not None:
            return self._num_proc
        from pyspark.sql import SparkSession

        from hvd_spark._internal.driver.launcher import resolve_launch_options

        spark = self._kwargs.get("spark") or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        return resolve_launch_options(spark, num_proc=None).num_proc

    def available_slots(self) -> int:
        """The barrier task slots of the executors registered now (elastic training sizes its attempts by
        them). A classic session only: Spark Connect does not show its executors to the client."""
        from pyspark.sql import SparkSession

        from hvd_spark._internal.common import internals
        from hvd_spark._internal.common.topology import task_slots

        spark = self._kwargs.get("spark") or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
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
        from pyspark.sql import SparkSession

        spark = self._kwargs.get("spark") or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
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
        return SparkBackend(num_proc=num_proc, env=self._env, **kwargs)


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

    def available_slots(self) -> int:
        return int(self.slots() if callable(self.slots) else self.slots)

    def with_num_proc(self, num_proc: int) -> "InProcessBackend":
        """This backend, now playing ``num_proc`` ranks (its counters go on)."""
        self._num_proc = num_proc
        return self


def rank_function(backend: Any) -> Callable[..., Any]:
    """What each rank runs in ``fit``: the backend's ``rank_fn`` when it has one, else hvd_spark's
    Keras training (``rank/train.py``; imported only then: it loads Keras)."""
    fn = getattr(backend, "rank_fn", None)
    if fn is not None:
        return fn
    from hvd_spark._internal.rank.train import train

    return train


def fit_backend(user_backend: Any, **launch_kwargs: Any) -> tuple[Any, Callable[..., Any]]:
    """The backend and rank function of one fit: the estimator's backend object, or a
    :class:`SparkBackend` over ``launch_kwargs`` (the fit's resolved ``options``, ``spark``,
    ``on_event``, ``channel``, ``description``)."""
    backend = user_backend if user_backend is not None else SparkBackend(**launch_kwargs)
    return backend, rank_function(backend)
