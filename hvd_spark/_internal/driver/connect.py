"""Spark Connect: the client has no JVM and accepts no connection from the cluster. The driver
service and its supervisor run in the first barrier task (:mod:`.coordinator`); the client submits
the stage, follows the job through the store (``common/channel.py``) and decides its result from
the stage's output rows with the same ``supervisor.conclude`` (:func:`launch_connect`)."""

import contextlib
import json
import logging
import posixpath
import time
import uuid

import cloudpickle

from hvd_spark._internal.common.outcomes import RankOutcome
from hvd_spark._internal.driver.options import LaunchOptions
from hvd_spark._internal.driver.stage import Stage, task_spec
from hvd_spark._internal.driver.supervisor import ClientWatch, JobReport, conclude

logger = logging.getLogger(__name__)


def launch_connect(spark, payload: bytes, options: LaunchOptions, *, on_event, description: str, channel, on_log=None):
    """Spark Connect: the driver service and supervisor run in the first barrier task
    (``coordinator.py``); this client submits the stage under a tag (to interrupt it), shows the
    channel's records and decides the result from the stage's rows."""
    import pandas as pd

    from hvd_spark._internal.common.channel import ChannelReader, show
    from hvd_spark._internal.data.store import job_config
    from hvd_spark._internal.driver.coordinator import OUTCOME, RECORDS, REPORT, ConnectJob, run_connect_task

    num_proc = options.num_proc
    tag = f"hvd_spark-{uuid.uuid4().hex[:12]}"
    reader = live = None
    if channel is not None:
        store, folder = channel
        path = posixpath.join(folder, tag)
        reader, live = ChannelReader(store, path), (job_config(store), path)
    job_spec = ConnectJob(task_spec(options, payload, "", ""), options, options.master, live)

    def task_fn(batches):
        for _ in batches:  # one row per task: only the task matters
            pass
        rows = run_connect_task(job_spec)
        if rows:  # an MPI task that only held its slot has none (an empty binary column does not convert)
            yield pd.DataFrame({"kind": [k for k, _ in rows], "data": [d for _, d in rows]})

    tags = [*spark.getTags(), tag]  # the caller's (read on its thread) and the stage's own

    def stage():
        with _tagged(spark, tags):
            df = spark.range(0, num_proc, 1, num_proc)
            return df.mapInPandas(task_fn, "kind string, data binary", barrier=True).collect()

    t0 = time.monotonic()
    job = Stage(stage, f"{tag}-submit", inheritable=False)

    def interrupt(why: str) -> None:
        logger.warning("interrupting the Spark Connect operations tagged %s: %s", tag, why)
        spark.interruptTag(tag)

    watch = ClientWatch(options, num_proc, options.master, interrupt, live=reader is not None)
    try:
        while job.alive():
            job.thread.join(1.0)
            if reader is not None:
                news = reader.poll()
                show(news, on_event, on_log)
                watch.see(news)
            if not watch.step():
                logger.error("the Spark Connect operations tagged %s did not stop after the interruption", tag)
                break
    except KeyboardInterrupt:
        watch.interrupt("interrupted on the client")
        raise
    finally:
        if reader is not None:
            show(reader.poll(), on_event, on_log)
            reader.remove()
    records: list[RankOutcome] = []
    report, kept = JobReport(), []
    for row in job.rows or []:
        kind, data = row["kind"], bytes(row["data"])
        if kind == OUTCOME:
            records.append(cloudpickle.loads(data))
        elif kind == REPORT:
            report = cloudpickle.loads(data)
        elif kind == RECORDS:
            kept = json.loads(data)
    show(kept, on_event, on_log)
    if watch.problem is not None:
        raise watch.problem
    return conclude(
        records,
        report,
        num_proc=num_proc,
        description=description,
        elapsed=time.monotonic() - t0,
        stage_error=job.error,
    )


@contextlib.contextmanager
def _tagged(spark, tags: list[str]):
    """The stage's thread carries ``tags`` while it submits the stage: Connect's tags are per thread, and
    the caller's must mark the stage's query too (``spark.interruptTag`` of one of them stops the
    training); the last one, the stage's own, marks that query only."""
    for t in tags:
        spark.addTag(t)
    try:
        yield
    finally:
        for t in tags:
            spark.removeTag(t)
