"""The driver side of a Horovod job on Spark barrier tasks.

:func:`launch` validates the request, starts the driver service, submits one barrier stage
of ``num_proc`` tasks in a background thread and watches it: tasks that do not start in
time, ranks that fail (the others are then aborted), and an optional overall timeout. It
knows nothing about Keras; the estimator builds on it.
"""

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from hvd_spark._internal import settings
from hvd_spark._internal.driver_service import KIND, Kind
from hvd_spark._internal.outcomes import ERROR, HOST_UNREACHABLE, OK, TASK_LOST, RankOutcome, TaskSpec, pick_failure
from hvd_spark._internal.sessions import require_classic
from hvd_spark._internal.topology import task_cpus, task_slots
from hvd_spark.errors import JobTimeoutError, LaunchError, RankFailedError

logger = logging.getLogger("hvd_spark")


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


_SLOTS = _SlotPool()


def available_slots(sc) -> int:
    """Task slots of the running Spark application, for barrier scheduling."""
    conf = sc.getConf()
    return task_slots(sc.master, default_parallelism=sc.defaultParallelism, task_cpus=task_cpus(conf))


def _driver_address(sc) -> str:
    conf = sc.getConf()
    host = conf.get("spark.driver.host", None) or "127.0.0.1"
    return host


BACKENDS = ("gloo", "mpi")


def resolve_backend(backend: str | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None) -> str:
    """The Horovod controller, ``"gloo"`` or ``"mpi"``, from ``backend`` or horovod's
    ``use_gloo`` / ``use_mpi`` flags (kept for ``horovod.spark.run`` compatibility)."""
    if use_gloo and use_mpi:
        raise ValueError(
            "Choose one controller: use_gloo=True or use_mpi=True, not both. Received: use_gloo=True, use_mpi=True."
        )
    flag = "mpi" if use_mpi else ("gloo" if use_gloo else None)
    if backend is not None and flag is not None and backend != flag:
        raise ValueError(
            f"backend={backend!r} contradicts use_{flag}=True. Pass one of them: backend is the same choice."
        )
    chosen = backend or flag or "gloo"
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' or 'mpi'. Received: backend={chosen!r}.")
    if chosen == "mpi" and not _mpi_available():
        raise ValueError(
            "backend='mpi' (use_mpi=True) needs Horovod built with MPI and mpirun on the PATH, and this "
            "installation has not both. Install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) and rerun "
            "scripts/setup.sh, or use the Gloo controller (backend='gloo')."
        )
    return chosen


_MPI_AVAILABLE: bool | None = None


def _mpi_available() -> bool:
    """Whether Horovod was built with MPI and mpirun exists; asked of a separate interpreter, so that
    the driver does not import TensorFlow (cached for the process)."""
    global _MPI_AVAILABLE
    if _MPI_AVAILABLE is None:
        import shutil
        import subprocess
        import sys

        code = "import horovod.tensorflow as hvd; print(bool(hvd.mpi_built()))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            built = out.returncode == 0 and out.stdout.strip().endswith("True")
        except subprocess.TimeoutExpired:
            built = False
        _MPI_AVAILABLE = built and shutil.which("mpirun") is not None
    return _MPI_AVAILABLE


@dataclass(frozen=True)
class LaunchOptions:
    """Everything a launch needs that can be known on the driver, resolved and checked before any
    work starts (:func:`resolve_launch_options`); ``fit`` resolves them before writing data."""

    num_proc: int
    slots: int
    backend: str
    num_threads: int
    start_timeout: float
    timeout: float | None
    abort_grace: float
    gloo_timeout: float
    env: dict[str, str] | None = None
    heartbeat_timeout: float = settings.DEFAULT_HEARTBEAT_TIMEOUT


def resolve_launch_options(
    sc,
    *,
    num_proc: int | None,
    backend: str | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
) -> LaunchOptions:
    """Checks a launch's options against the running application: the one place for the slot check."""
    conf = sc.getConf()
    slots = available_slots(sc)
    if num_proc is None:
        num_proc = slots
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a positive integer. Received: num_proc={num_proc!r}.")
    if num_proc > slots:
        raise ValueError(
            f"num_proc must be at most the number of task slots ({slots}) for a barrier stage. Received: "
            f"num_proc={num_proc}. Lower num_proc or add executors / cores (master={sc.master}, "
            f"spark.task.cpus={task_cpus(conf)})."
        )
    if env is not None and (
        not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must map str to str.")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be a positive integer. Received: num_threads={num_threads!r}.")
    return LaunchOptions(
        num_proc=num_proc,
        slots=slots,
        backend=resolve_backend(backend, use_gloo, use_mpi),
        num_threads=num_threads if num_threads is not None else task_cpus(conf),
        start_timeout=settings.seconds_setting(
            start_timeout,
            settings.ENV_START_TIMEOUT,
            conf.get(settings.CONF_START_TIMEOUT, None),
            settings.DEFAULT_START_TIMEOUT,
            "start_timeout",
        ),
        timeout=settings.parse_seconds("timeout", timeout) if timeout is not None else None,
        abort_grace=settings.seconds_setting(
            None, settings.ENV_ABORT_GRACE, None, settings.DEFAULT_ABORT_GRACE, "abort_grace"
        ),
        gloo_timeout=settings.seconds_setting(
            None, settings.ENV_GLOO_TIMEOUT, None, settings.DEFAULT_GLOO_TIMEOUT, "gloo_timeout"
        ),
        heartbeat_timeout=max(
            2 * settings.HEARTBEAT_INTERVAL,
            settings.seconds_setting(
                None, settings.ENV_HEARTBEAT_TIMEOUT, None, settings.DEFAULT_HEARTBEAT_TIMEOUT, "heartbeat_timeout"
            ),
        ),
        env=dict(env) if env is not None else None,
    )


def pickled_payload(fn: Callable, args=(), kwargs=None) -> bytes:
    """``(fn, args, kwargs)`` pickled for the ranks; a clear error names what does not pickle."""
    if not callable(fn):
        raise TypeError(f"fn must be callable. Received: {type(fn).__name__}.")
    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(f"fn and its arguments must be picklable with cloudpickle: {e}") from e


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


def _vanished_ranks(service, known: set[int]) -> list[RankOutcome]:
    """Failures for the ranks whose task's connection closed before they finished, unless something
    better is known about them (their own record or failure report)."""
    out = []
    for partition, when in service.vanished.items():
        rank = service.rank_of_partition.get(partition)
        if rank is None or rank in known:
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


def _where_ranks_were(records: list[RankOutcome], ranks: list[int]) -> str:
    """The innermost Python frames of each listed rank, from the stacks they printed on abort."""
    out = []
    for rec in sorted(records, key=lambda r: r.rank):
        if rec.rank not in ranks or not rec.tail:
            continue
        tail = rec.tail
        starts = [
            i for i, line in enumerate(tail) if line.startswith(("Stack (most recent call first)", "Current thread"))
        ]
        if not starts:
            continue
        frames = [line.strip() for line in tail[starts[-1] + 1 :] if line.strip().startswith("File ")]
        out.append(f"  rank {rec.rank}: " + " <- ".join(frames[:6]))
    return "\n".join(out)


def launch(
    fn: Callable,
    args=(),
    kwargs=None,
    *,
    num_proc: int | None = None,
    spark=None,
    backend: str | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
    start_timeout: float | None = None,
    timeout: float | None = None,
    on_event: Callable[[int, dict], None] | None = None,
    description: str = "hvd_spark job",
    options: LaunchOptions | None = None,
) -> list[Any]:
    """Runs ``fn`` on Horovod ranks; see :func:`hvd_spark.run` for the arguments.

    ``options``, resolved earlier with :func:`resolve_launch_options`, replaces the option
    arguments (the estimator resolves them before it writes any data).
    """
    from pyspark.sql import SparkSession

    payload = pickled_payload(fn, args, kwargs)
    spark = spark or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    require_classic(spark, description)
    sc = spark.sparkContext
    if options is None:
        options = resolve_launch_options(
            sc,
            num_proc=num_proc,
            backend=backend,
            use_gloo=use_gloo,
            use_mpi=use_mpi,
            env=env,
            num_threads=num_threads,
            start_timeout=start_timeout,
            timeout=timeout,
        )
    with _SLOTS.claim(sc.applicationId, options.num_proc, options.slots, description):
        return _launch_claimed(sc, payload, options, on_event=on_event, description=description)


def _launch_claimed(sc, payload: bytes, options: LaunchOptions, *, on_event, description: str) -> list[Any]:
    """Submits the barrier stage and watches it (the slots are claimed)."""
    from pyspark import InheritableThread

    from hvd_spark._internal.driver_service import DriverService
    from hvd_spark._internal.logs import rank_env_defaults

    num_proc, start_timeout, timeout = options.num_proc, options.start_timeout, options.timeout
    abort_grace = options.abort_grace
    service = DriverService(num_proc, on_event=on_event)
    port = service.start()
    spec = TaskSpec(
        driver_addr=f"{_driver_address(sc)}:{port}",
        token=service.token,
        payload=payload,
        backend=options.backend,
        env=rank_env_defaults(options.env),
        num_threads=int(options.num_threads),
        gloo_timeout=options.gloo_timeout,
        abort_grace=abort_grace,
        heartbeat_timeout=options.heartbeat_timeout,
    )
    group = f"hvd_spark-{uuid.uuid4().hex[:12]}"
    box: dict[str, Any] = {}

    def task_fn(_):
        from hvd_spark._internal.task import run_task

        return run_task(spec)

    def submit():
        sc.setJobGroup(group, f"{description}: {num_proc} Horovod ranks", interruptOnCancel=True)
        try:
            box["records"] = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task_fn).collect()
        except BaseException as e:  # noqa: BLE001 - re-raised below, with what the driver knows
            box["error"] = e

    logger.info("starting %d ranks (%s) on %s", num_proc, options.backend, sc.master)
    t0 = time.monotonic()
    thread = InheritableThread(target=submit, name=f"{group}-submit")
    thread.daemon = True
    thread.start()
    problem: BaseException | None = None
    lost: list[RankOutcome] = []  # ranks whose task stopped answering (found by the driver)
    aborted_at: float | None = None
    cancelled = False
    all_done_sent = False
    next_beat = time.monotonic() + settings.HEARTBEAT_INTERVAL
    try:
        while thread.is_alive():
            service.wait(0.2)
            now = time.monotonic()
            if now >= next_beat:
                service.broadcast({KIND: Kind.BEAT})
                next_beat = now + settings.HEARTBEAT_INTERVAL
            if not lost and aborted_at is None:
                lost = _lost_ranks(service, options.heartbeat_timeout)
                if lost:
                    what = f"rank {lost[0].rank} on host {lost[0].host}: {lost[0].message}"
                    logger.error("%s; stopping the other ranks", what)
                    service.broadcast({KIND: Kind.ABORT, "reason": what})
                    aborted_at = now
            started, rank_of, done, failures, _ = service.snapshot()
            if failures and aborted_at is None:
                first = failures[0]
                logger.error("rank %s failed (%s); stopping the other ranks", first["rank"], first["type"])
                service.broadcast({KIND: Kind.ABORT, "reason": f"rank {first['rank']} failed"})
                aborted_at = now
            if len(done) == num_proc and not all_done_sent:
                service.broadcast({KIND: Kind.ALL_DONE})
                all_done_sent = True
            if problem is None and len(started) < num_proc and now - t0 > start_timeout:
                missing = sorted(set(range(num_proc)) - set(started))
                problem = JobTimeoutError(
                    f"{len(missing)} of {num_proc} barrier tasks did not start within start_timeout="
                    f"{start_timeout:g}s (tasks/partitions {missing}). Spark could not schedule them all at once: "
                    f"check that {num_proc} task slots are free (master={sc.master}) or raise start_timeout "
                    f"({settings.ENV_START_TIMEOUT}).",
                    ranks=missing,
                )
            if problem is None and timeout is not None and now - t0 > timeout:
                missing = sorted(set(range(num_proc)) - set(done))
                problem = JobTimeoutError(
                    f"the job did not finish within timeout={timeout:g}s; ranks {missing} had not finished.",
                    ranks=missing,
                )
            if problem is not None and aborted_at is None:
                service.broadcast({KIND: Kind.ABORT, "reason": str(problem), "dump": True})
                aborted_at = now
            if aborted_at is not None and not cancelled and now - aborted_at > abort_grace + 10:
                # Tasks that do not react to the abort are cancelled through Spark.
                logger.warning("cancelling Spark job group %s", group)
                sc.cancelJobGroup(group)
                cancelled = True
            if cancelled and aborted_at is not None and now - aborted_at > abort_grace + 70:
                logger.error("Spark job group %s did not stop after cancellation", group)
                break
    except KeyboardInterrupt:
        service.broadcast({KIND: Kind.ABORT, "reason": "interrupted on the driver"})
        sc.cancelJobGroup(group)
        raise
    finally:
        service.stop()
    elapsed = time.monotonic() - t0
    _, _, _, failures, _ = service.snapshot()

    hosts = {service.rank_of_partition.get(p): h for p, h in service.host_of.items()}
    records: list[RankOutcome] = [
        dataclasses.replace(r, host=hosts.get(r.rank, "")) for r in map(cloudpickle.loads, box.get("records") or [])
    ]
    errors = [r for r in records if r.status == ERROR] + lost
    # Failures reported, whose task's record did not come back (the job was cancelled), and ranks
    # whose task vanished without a word (its executor or host died).
    returned = {r.rank for r in records}
    errors += [
        dataclasses.replace(RankOutcome.from_message(f), host=hosts.get(int(f["rank"]), ""))
        for f in failures
        if int(f["rank"]) not in returned
    ]
    errors += _vanished_ranks(service, returned | {r.rank for r in errors})
    if errors:
        _raise_failure(pick_failure(errors))
    if problem is not None:
        if isinstance(problem, JobTimeoutError) and records:
            where = _where_ranks_were(records, problem.ranks)
            if where:
                problem = JobTimeoutError(f"{problem}\nWhere each unfinished rank was:\n{where}", ranks=problem.ranks)
        raise problem
    if "error" in box:
        raise LaunchError(f"the Spark barrier stage of {description} failed: {box['error']}") from box["error"]
    by_rank = {r.rank: r for r in records}
    missing = sorted(set(range(num_proc)) - set(by_rank))
    if missing:
        raise LaunchError(f"ranks {missing} returned no result (job ended after {elapsed:.1f}s).")
    not_ok = [r for r in by_rank.values() if r.status != OK or r.result is None]
    if not_ok:
        raise LaunchError(f"ranks {sorted(r.rank for r in not_ok)} were aborted without a reported failure.")
    logger.info("%d ranks finished in %.1fs", num_proc, elapsed)
    return [cloudpickle.loads(by_rank[r].result) for r in range(num_proc)]
