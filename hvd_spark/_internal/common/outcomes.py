"""How a rank ended, as it travels from the rank's process to the driver, and which failure of
several is the cause. Also the spec that the launcher gives every barrier task.

The path of a failure: the rank's process (``rank/entry.py``) writes a :class:`RankOutcome` next to
its work dir; its task (``task/barrier.py``) reads it (or makes a ``ProcessDied`` one when the process
left nothing), sends it to the driver as a ``fail`` message (:meth:`RankOutcome.to_message`) and
returns it through Spark; the supervisor (on the driver, or in the first barrier task on Spark
Connect) picks the cause with :func:`pick_failure` and raises
``RankFailedError``. Pure Python: no Spark, no TensorFlow.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

OK, ERROR, ABORTED = "ok", "error", "aborted"
PROCESS_DIED = "ProcessDied"  # the type of a rank whose process ended without reporting
HOST_UNREACHABLE = "HostUnreachable"  # the type of a rank whose task stopped answering the driver
TASK_LOST = "TaskLost"  # the type of a rank whose task's connection closed before it finished
STATE_PREFIX = "[hvd_spark] rank process state: "  # a line its task adds before asking for the stack

# Failures that follow from another rank's failure (its peer went away), not causes of their own.
_SECONDARY_TYPES = ("HorovodInternalError", "HorovodShutdown")
_SECONDARY_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "horovod has been shut down",
    "horovodallreduce",
    "horovodallgather",
    "horovodbroadcast",
    "horovodgroupedallreduce",
    "gloo",
)


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended: ``status`` is ``"ok"`` (with ``result``), ``"error"`` or ``"aborted"``
    (stopped because another rank failed or the job was cancelled)."""

    rank: int
    status: str
    result: bytes | None = None  # ok: the cloudpickled return value
    type: str = ""  # error: the exception's qualified type, or "ProcessDied"
    message: str = ""
    traceback: str = ""  # the remote traceback, or the last output lines of a process that died
    time: float | None = None  # when the error happened (epoch seconds)
    pickled: bytes | None = None  # the cloudpickled exception, when it pickles
    tail: tuple[str, ...] = field(default=())  # last output lines (with the stack printed on abort)
    host: str = ""  # the host's address, filled in by the driver (which sees every task's connection)

    @property
    def is_secondary(self) -> bool:
        """True for errors that a rank gets because another rank died (a collective lost its peer)."""
        if self.type in (PROCESS_DIED, HOST_UNREACHABLE, TASK_LOST):
            return False
        if any(t in self.type for t in _SECONDARY_TYPES):
            return True
        text = self.message.lower()
        return any(t in text for t in _SECONDARY_TEXT)

    def to_message(self) -> dict[str, Any]:
        """The fields of an error that go to the driver as a ``fail`` message (JSON)."""
        return {"rank": self.rank, "type": self.type, "message": self.message[:2000], "time": self.time}

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> "RankOutcome":
        """An error outcome from a ``fail`` message (when the task's own record never came back)."""
        return cls(
            rank=int(msg["rank"]),
            status=ERROR,
            type=str(msg.get("type") or "?"),
            message=str(msg.get("message") or ""),
            time=msg.get("time"),
        )

    def as_aborted(self) -> "RankOutcome":
        return replace(self, status=ABORTED, type="", message="", traceback="", pickled=None)


def pick_failure(failures: Sequence[RankOutcome]) -> RankOutcome:
    """The failure that caused the others: not a peer-lost error if there is one, then the earliest."""
    if not failures:
        raise ValueError("pick_failure needs at least one failure.")
    return min(failures, key=lambda o: (o.is_secondary, o.time if o.time is not None else float("inf"), o.rank))


@dataclass(frozen=True)
class TaskSpec:
    """What every barrier task of a job receives from the launcher (pickled into the stage)."""

    driver_addr: str  # host:port of the driver service
    token: str  # the job's secret for the driver service
    payload: bytes  # cloudpickled (fn, args, kwargs)
    backend: str  # "gloo" or "mpi"
    env: dict[str, str]  # extra environment for every rank
    num_threads: int
    gloo_timeout: float
    abort_grace: float
    heartbeat_timeout: float = 30.0  # a task that hears nothing from the driver this long stops its rank
    warm: bool = False  # ask the host's warm server (warm.py) for the rank, if it can serve
    warm_set: bool = False  # the driver decided warm; else the executor's own HVD_SPARK_WARM may turn it off
    app: str = ""  # the Spark application's id: warm servers are not shared across applications
    start_timeout: float = 600.0  # how long a task waits for a warm server to be ready
    use_gpu: bool = False  # each rank gets its task's GPUs (topology.gpu_env)
