"""The first barrier task as the job's coordinator, for jobs launched through Spark Connect.

A Connect client has no SparkContext and accepts no connection from the cluster, so the driver
service and its supervisor, which a classic launch runs on the driver, run here instead: in a
thread of the first barrier task. Every task learns the coordinator's address and token from
the stage's first ``allGather`` and then runs exactly as on a classic session (``task/barrier.py``).
What the client needs comes back with the stage's output rows (every task's outcomes, the
coordinator's :class:`JobReport`) and, while the job runs, through the channel (``common/channel.py``).
"""

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import cloudpickle

from hvd_spark._internal.common.channel import ChannelWriter
from hvd_spark._internal.common.outcomes import TaskSpec
from hvd_spark._internal.common.service import DriverService
from hvd_spark._internal.driver.supervisor import GIVE_UP_AFTER, Supervisor

logger = logging.getLogger(__name__)

OUTCOME, REPORT, RECORDS = "outcome", "report", "records"  # the kinds of the stage's output rows


@dataclass(frozen=True)
class ConnectJob:
    """What every barrier task of a Connect launch receives (pickled into the stage)."""

    spec: TaskSpec  # without driver_addr and token: the coordinator makes them
    options: Any  # the launch's LaunchOptions
    where: str  # the master URL, for messages
    channel: tuple[dict, str] | None  # (store config, folder) of a live channel, or None


def _task_host(ctx, partition: int) -> str:
    """This task's executor address as Spark knows it (what the other tasks can reach)."""
    address = ctx.getTaskInfos()[partition].address
    return address.rsplit(":", 1)[0] if ":" in address else address


class Coordinator:
    """The driver service and supervisor of a job, in the first barrier task."""

    def __init__(self, job: ConnectJob, host: str):
        from hvd_spark._internal.data.store import Store

        store = Store.from_config(job.channel[0]) if job.channel else None
        self.writer = ChannelWriter(store, job.channel[1] if job.channel else None)
        self.options = job.options
        self.service = DriverService(job.options.num_proc, on_event=self.writer.event, on_log=self.writer.log)
        port = self.service.start()
        self.addr, self.token = f"{host}:{port}", self.service.token
        self.supervisor = Supervisor(
            self.service,
            job.options,
            where=job.where,
            say=self.writer.say,
            on_abort=lambda reason: self.writer.put({"k": "abort", "reason": reason}),
        )
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hvd_spark-coordinator")
        self._thread.start()

    def _watch(self) -> None:
        said_start = False
        try:
            while True:
                self.service.wait(0.2)
                self.supervisor.step()
                if not said_start and len(self.service.snapshot()[0]) == self.service.num_proc:
                    self.writer.put({"k": "start"})
                    said_start = True
                if self.supervisor.settled() or self.supervisor.should_give_up():
                    return
        except Exception:  # never leave the job unwatched silently
            logger.exception("the coordinator of this job failed")
            self.supervisor.interrupt("the job's coordinator failed")
        finally:
            self._ended.set()

    def finish(self) -> tuple[bytes, list[dict]]:
        """Waits (bounded) until every task is done, stops the service; returns the pickled report
        and the channel's kept records."""
        self._ended.wait(self.options.abort_grace + GIVE_UP_AFTER + 10)
        report = self.supervisor.report()
        self.service.stop()
        return cloudpickle.dumps(report), self.writer.close()


def run_connect_task(job: ConnectJob) -> list[tuple[str, bytes]]:
    """The body of one barrier task of a Connect launch: ``(kind, data)`` rows for the client."""
    from pyspark import BarrierTaskContext

    from hvd_spark._internal.task.barrier import run_task

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    coordinator = Coordinator(job, _task_host(ctx, partition)) if partition == 0 else None
    published = json.dumps({"addr": coordinator.addr, "token": coordinator.token}) if coordinator else ""
    rows: list[tuple[str, bytes]] = []
    try:
        found = next(json.loads(m) for m in ctx.allGather(published) if m)
        spec = dataclasses.replace(job.spec, driver_addr=found["addr"], token=found["token"])
        rows += [(OUTCOME, r) for r in run_task(spec)]
    except BaseException as e:
        if coordinator is not None:
            coordinator.supervisor.interrupt(f"the coordinator's task failed: {e}")
        raise
    finally:
        if coordinator is not None:
            report, kept = coordinator.finish()
            rows.append((REPORT, report))
            rows.append((RECORDS, json.dumps(kept).encode()))
    return rows
