"""A classic session: the driver service and its supervisor run here, on the Spark driver, while
the barrier stage runs in a background thread (:func:`launch_classic`)."""

import contextlib
import logging
import re
import time
import uuid
from typing import Any

import cloudpickle

from hvd_spark._internal.driver.options import LaunchOptions
from hvd_spark._internal.driver.stage import Stage, task_spec
from hvd_spark._internal.driver.supervisor import Supervisor, conclude
from hvd_spark.errors import JobCancelledError

logger = logging.getLogger(__name__)


def _driver_address(sc) -> str:
    conf = sc.getConf()
    host = conf.get("spark.driver.host", None) or "127.0.0.1"
    return host


def task_cpus_profile(cpus: int):
    """A ``ResourceProfile`` whose tasks each ask for ``cpus`` CPUs (a TaskResourceProfile: the executors
    stay as they are; Spark schedules fewer of these tasks on each)."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    return ResourceProfileBuilder().require(TaskResourceRequests().cpus(int(cpus))).build


def launch_classic(sc, payload: bytes, options: LaunchOptions, *, on_event, description: str, on_log=None) -> list[Any]:
    """A classic session: the driver service and its supervisor run here, on the Spark driver."""
    from hvd_spark._internal.common.service import DriverService

    num_proc = options.num_proc
    service = DriverService(num_proc, on_event=on_event, on_log=on_log)
    port = service.start()
    spec = task_spec(options, payload, f"{_driver_address(sc)}:{port}", service.token)
    tag = f"hvd_spark-{uuid.uuid4().hex[:12]}"  # the stage's job tag (and job group, when the caller has none)

    def task_fn(_):
        from hvd_spark._internal.task.barrier import run_task

        return run_task(spec)

    def stage():
        with _tagged(sc, tag, f"{description}: {num_proc} Horovod ranks"):
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task_fn)
            if options.task_cpus:  # each barrier task asks for its rank's cores (stage-level scheduling)
                rdd = rdd.withResources(task_cpus_profile(options.task_cpus))
            return rdd.collect()

    t0 = time.monotonic()
    supervisor = Supervisor(service, options, where=sc.master)
    job = Stage(
        stage, f"{tag}-submit", inheritable=True, on_end=service.wake
    )  # inherits the caller's job group and tags
    cancelled = False
    try:
        try:
            while job.alive():
                service.wait(0.2)
                supervisor.step()
                if supervisor.should_cancel() and not cancelled:
                    # Tasks that do not react to the abort are cancelled through Spark.
                    logger.warning("cancelling the Spark jobs tagged %s", tag)
                    sc.cancelJobsWithTag(tag)
                    cancelled = True
                if cancelled and supervisor.should_give_up():
                    logger.error("the Spark jobs tagged %s did not stop after cancellation", tag)
                    break
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (driver/signals.py)
            supervisor.interrupt("interrupted on the driver")
            try:
                sc.cancelJobsWithTag(tag)
            except Exception as e:  # the JVM is gone too (a whole process group stopped): the ranks still are
                logger.warning("could not cancel the Spark jobs tagged %s: %s", tag, str(e).splitlines()[0])
            _wait_for_ranks(service, tag)
            raise
        if job.error is not None and not job.alive():  # failed or cancelled: its ranks must be gone first
            if not cancelled:
                supervisor.interrupt("the Spark job ended with an error")
            _wait_for_ranks(service, tag)
    finally:
        if not job.alive() and job.error is None:  # (a failed stage's ranks were waited for above)
            # The tasks closed their connections before the stage ended: read what they sent last
            # (a stalled rank's stack, the last output lines) before the service closes them.
            service.wait_until_stopped(2.0, silent_after=options.heartbeat_timeout)
        service.stop()
    if job.error is not None and not cancelled and _was_cancelled(job.error):
        raise JobCancelledError(
            f"the Spark job of {description} was cancelled (outside hvd_spark: cancelAllJobs, the job group or a "
            f"job tag it ran under (its own tag: {tag}), or an interrupt); its ranks have stopped. Spark said: "
            f"{str(job.error).strip().splitlines()[0]}"
        ) from job.error
    records = [cloudpickle.loads(r) for r in job.rows or []]
    return conclude(
        records,
        supervisor.report(),
        num_proc=num_proc,
        description=description,
        elapsed=time.monotonic() - t0,
        stage_error=job.error,
    )


@contextlib.contextmanager
def _tagged(sc, tag: str, description: str):
    """The stage's thread, while it submits the stage: the job tag ``tag`` (hvd_spark cancels the stage by
    it) added to the job group and tags it inherited from the caller's thread, so that cancelling the
    user's group (``sc.cancelJobGroup``) or tag (``sc.cancelJobsWithTag``) stops the training too. Only
    a thread without a job group gets ``tag`` as its group as well (the Spark UI's grouping). The local
    properties it changes are put back at the end (they are this thread's copy, unless pyspark's
    pinned threads are off)."""
    keys = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    before = {k: sc.getLocalProperty(k) for k in keys}
    if before["spark.jobGroup.id"] is None:
        sc.setJobGroup(tag, description, interruptOnCancel=True)
    else:
        logger.info("the barrier stage runs in the caller's Spark job group %s", before["spark.jobGroup.id"])
        sc.setInterruptOnCancel(True)  # cancelling stops the ranks' tasks at once
    sc.addJobTag(tag)
    try:
        yield
    finally:
        sc.removeJobTag(tag)
        for k, v in before.items():
            sc.setLocalProperty(k, v)


_SPARK_CANCELLED = re.compile(
    r"Job \d+ cancelled|cancelled job group|cancelled job tag|cancellation of all jobs|SPARK_JOB_CANCELLED|"
    r"cancelled because SparkContext was shut down|Job aborted due to stage cancellation|"
    r"Stage \d+ cancelled|cancelled as part of cancellation",
    re.IGNORECASE,
)


def _was_cancelled(error: BaseException) -> bool:
    """Whether a barrier stage's error is Spark's cancellation of its job (not a task's failure whose
    text happens to mention a cancelled operation): Spark's own wording, before any task traceback."""
    head = str(error).split("Traceback (most recent call last)", 1)[0]
    return bool(_SPARK_CANCELLED.search(head[:4000]))


def _wait_for_ranks(service, tag: str) -> None:
    """After a failed or cancelled job: returns once every task and rank process of it has exited (its
    connection to the driver closed), or after ``HVD_SPARK_STOP_WAIT`` seconds, naming what is left."""
    from hvd_spark._internal.common import settings

    # Tasks silent for two heartbeats (a lost host, a dead executor: their connections may stay half
    # open) and their ranks are not waited for.
    stop_wait = settings.STOP_WAIT.get()
    left = service.wait_until_stopped(stop_wait, silent_after=2 * settings.HEARTBEAT_INTERVAL + 1)
    if left:
        logger.error(
            "%s of the Spark jobs tagged %s still running %.0fs after the job ended; they stop when they next reach "
            "their task or the store",
            ", ".join(left),
            tag,
            stop_wait,
        )
