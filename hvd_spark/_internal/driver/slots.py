"""Task slots: how many barrier task slots the application has (cluster discovery: a classic
session's registered executors, a Connect session's conf and default parallelism) and which of
them the jobs of this driver process hold (the slot pool, :data:`SLOTS`).
"""

import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.sessions import application_id, is_connect
from hvd_spark._internal.common.topology import (
    barrier_refusal,
    executor_target,
    executors_settled,
    judge_slots,
    slots_from_master_url,
    stage_profiles_supported,
    task_cpus,
    task_slots,
)

logger = logging.getLogger(__name__)


class _SlotPool:
    """Task slots claimed by the hvd_spark jobs of this driver process, per Spark application.

    A barrier stage needs all its slots at once. When jobs of one driver run side by side
    (``CrossValidator(parallelism=2)``, fits from several threads) and together need more slots
    than the application has, the later ones wait here, before their ``start_timeout`` clock
    starts, instead of timing out while Spark holds their tasks back. The wait lasts as long as
    the jobs holding the slots, each of which is bounded by its own timeouts.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._used: dict[str, int] = {}

    def held(self, app: str) -> int:
        """The slots of application ``app`` that this driver's jobs hold now."""
        with self._cond:
            return self._used.get(app, 0)

    @contextlib.contextmanager
    def claim(self, app: str, n: int, total: int, description: str):
        t0 = last_log = time.monotonic()
        with self._cond:
            while self._used.get(app, 0) and self._used[app] + n > total:
                if time.monotonic() - last_log >= 30 or last_log == t0:
                    logger.info(
                        "%s waits for %d task slots: %d of %d are held by other hvd_spark jobs of this "
                        "driver (waiting %.0fs)",
                        description,
                        n,
                        self._used[app],
                        total,
                        time.monotonic() - t0,
                    )
                    last_log = time.monotonic()
                self._cond.wait(5.0)
            self._used[app] = self._used.get(app, 0) + n
        try:
            yield
        finally:
            with self._cond:
                self._used[app] -= n
                self._cond.notify_all()


SLOTS = _SlotPool()  # the one pool of this driver process


@dataclass(frozen=True)
class Cluster:
    """What a launch needs to know of the running application."""

    app: str  # the application's id (the slot pool's key)
    master: str  # the master URL
    slots: int | None  # barrier task slots; None where a Connect session cannot tell
    conf: Any  # the application's settings: anything with get(key, default)
    executors: int | None = None  # executors registered (a classic session on a cluster master; local-cluster's URL)
    profiles: bool = False  # Spark gives a barrier stage its own task CPUs here (stage-level scheduling)


def cluster_of(spark, *, num_proc: int | None = None, start_timeout: float | None = None) -> Cluster:
    """The application behind ``spark``: from its SparkContext on a classic session; on Spark Connect
    from its runtime conf and, where the master URL does not say, from the partitions of a small
    ``range`` (Spark splits it into the application's default parallelism, its total cores).

    On a classic session with a cluster master the slots are those of the executors that registered
    (:func:`_registered_slots`, which waits a bounded time for them and raises ``ValueError`` when
    ``num_proc`` ranks could never be scheduled); ``start_timeout`` (as passed to the launch) bounds
    that wait."""
    if not is_connect(spark):
        sc = spark.sparkContext
        conf = sc.getConf()
        refusal = barrier_refusal(sc.master, conf)
        if refusal:
            raise ValueError(refusal)
        executors: int | None = None
        if slots_from_master_url(sc.master):
            slots = task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=task_cpus(conf))
            workers = _LOCAL_CLUSTER_WORKERS.match(sc.master.strip())
            executors = int(workers.group(1)) if workers else None
        else:
            slots = _registered_slots(sc, conf, num_proc, start_timeout)
            try:
                executors = _executor_count(sc)[0] or None
            except Exception as e:  # no JVM access to the scheduler: executors unknown (one rank per slot)
                logger.debug("counting the registered executors failed: %s", e)
        profiles = stage_profiles_supported(sc.master, sc.version, conf)
        return Cluster(sc.applicationId, sc.master, slots, conf, executors, profiles)
    conf = spark.conf
    master = conf.get("spark.master", None) or "?"
    refusal = barrier_refusal(master, _ConnectConf(conf))
    if refusal:
        raise ValueError(refusal)
    app = application_id(spark)
    cpus = task_cpus(conf)
    m = _LOCAL_N.match(master)
    if m or master.startswith("local-cluster"):
        return Cluster(app, master, task_slots(master, default_parallelism=0, task_cpus=cpus), conf)
    parallelism = _default_parallelism(spark)
    if parallelism is None:
        return Cluster(app, master, None, conf)
    slots = task_slots(master, default_parallelism=parallelism, task_cpus=cpus, cpu_count=parallelism)
    return Cluster(app, master, slots, conf)


_LOCAL_N = re.compile(r"^local(\[\d+(,\s*\d+)?\])?$")
_LOCAL_CLUSTER_WORKERS = re.compile(r"^local-cluster\[\s*(\d+)\s*,")


class _ConnectConf:
    """A Connect session's runtime conf, read without failing on keys the server does not show."""

    def __init__(self, conf):
        self._conf = conf

    def get(self, key, default=None):
        try:
            return self._conf.get(key, default)
        except Exception:  # a server that refuses to show a static conf: as unset
            return default


_SETTLED: dict[str, int] = {}  # application id -> executors once its count was complete (standalone)
_SLOT_POLL = 0.25  # seconds between two counts of the registered executors
_SLOT_LOG_EVERY = 10.0


def _executor_count(sc) -> tuple[int, int]:
    """The executors registered with the application and their barrier task slots: the number
    Spark's own barrier check uses (``SparkContext.maxNumConcurrentTasks`` of the default resource
    profile: each active executor's cores / spark.task.cpus, fewer where its GPUs or other resources
    allow fewer tasks)."""
    from hvd_spark._internal.common import internals

    return internals.spark_executor_slots(sc)


def _registered_slots(sc, conf, num_proc: int | None, start_timeout: float | None) -> int:
    """The barrier task slots of a classic application on a cluster master, counted on the executors
    that registered. Waits for them up to ``HVD_SPARK_EXECUTOR_WAIT`` seconds (default 30, never
    longer than start_timeout): until there are enough for ``num_proc``, every executor the conf asks
    for has registered, or (standalone) their count held still for a few seconds. Raises ValueError
    when ``num_proc`` ranks could never be scheduled, naming the numbers (:func:`judge_slots`)."""
    cpus = task_cpus(conf)
    try:
        reading = _executor_count(sc)
    except Exception as e:  # no JVM access to the scheduler: the application's default parallelism
        logger.debug("counting the registered executors failed (%s): slots from defaultParallelism", e)
        return task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=cpus)
    limit = min(
        settings.EXECUTOR_WAIT.get(conf=conf),
        settings.START_TIMEOUT.get(start_timeout, conf=conf),
    )
    target = executor_target(sc.master, conf, cpus)
    app = sc.applicationId
    t0 = changed = last_log = time.monotonic()
    complete = logged = False
    while True:
        executors, slots = reading
        now = time.monotonic()
        # Complete: every executor there will be has registered (or as many as an earlier count of
        # this standalone application found complete).
        complete = executors_settled(None, executors, slots, target, now - changed, settings.EXECUTORS_SETTLE) or (
            target.settles and executors >= _SETTLED.get(app, 1 << 30)
        )
        if complete or (num_proc is not None and slots >= num_proc) or now - t0 >= limit:
            break
        if not logged or now - last_log >= _SLOT_LOG_EVERY:
            asked = (
                f"{target.executors} asked for: {target.source}" if target.executors is not None else "count settles"
            )
            logger.info(
                "waiting up to %.0fs for the executors to register (%s): %d registered with %d task slots "
                "(spark.task.cpus=%d), num_proc=%s (%.0fs)",
                limit,
                asked,
                executors,
                slots,
                cpus,
                num_proc if num_proc is not None else "all slots",
                now - t0,
            )
            last_log, logged = now, True
        time.sleep(_SLOT_POLL)
        try:
            new = _executor_count(sc)
        except Exception as e:
            logger.debug("counting the registered executors failed: %s", e)
            new = reading
        if new != reading:
            changed = time.monotonic()
        reading = new
    waited = time.monotonic() - t0
    executors, slots = reading
    if complete and target.settles:
        _SETTLED[app] = max(executors, _SETTLED.get(app, 0))
    log = logger.info if waited >= 0.5 else logger.debug
    log("%d executors registered with %d task slots (spark.task.cpus=%d) after %.1fs", executors, slots, cpus, waited)
    verdict = judge_slots(
        num_proc,
        executors=executors,
        slots=slots,
        target=target,
        settled=complete,
        waited=waited,
        master=sc.master,
        task_cpus=cpus,
        default_parallelism=conf.get("spark.default.parallelism", None),
        wait_setting=f"{settings.ENV_EXECUTOR_WAIT} or {settings.CONF_EXECUTOR_WAIT}, now {limit:.0f}s",
    )
    if verdict.error:
        raise ValueError(verdict.error)
    if verdict.warning:
        logger.warning("%s", verdict.warning)
    return verdict.slots


def _default_parallelism(spark) -> int | None:
    """The application's default parallelism seen through Spark Connect, or None if it cannot be told."""
    conf = _ConnectConf(spark.conf)
    if conf.get("spark.sql.leafNodeDefaultParallelism", None) or conf.get("spark.default.parallelism", None):
        return None  # range() is split by that setting, not by the cores
    from pyspark.sql import functions as F

    try:
        row = spark.range(0, 1 << 16).select(F.max(F.spark_partition_id()).alias("p")).collect()[0]
        return int(row["p"]) + 1
    except Exception as e:  # the server refused the query: the caller asks for num_proc
        logger.debug("counting the default parallelism failed: %s", e)
        return None
