"""Errors raised by hvd_spark at run time.

Argument problems raise the built-in ``ValueError`` / ``TypeError``. Failures of a running
job raise a subclass of :class:`HvdSparkError`; each is picklable, since errors cross the
executor / driver boundary.
"""


class HvdSparkError(RuntimeError):
    """Base class of hvd_spark's run-time errors."""


class DataChangedError(HvdSparkError):
    """A file of a table read in place (``materialize="auto"`` / ``"never"``) was removed or changed
    (size, modification time, rows) after the fit listed it: the fit stops instead of training on
    half-old, half-new data. Never restarted: fit again to train on the table as it is now."""


class LaunchError(HvdSparkError):
    """The Horovod job could not be started or was lost (tasks not scheduled, not answering)."""


class JobCancelledError(HvdSparkError):
    """The Spark job of a fit or ``run`` was cancelled from outside (``cancelAllJobs``, a cancelled job
    group, a notebook interrupt). Never restarted: the fit returns once its ranks have stopped."""


class RankFailedError(HvdSparkError):
    """A rank's function raised, or its process died.

    Attributes:
        rank: the Horovod rank that failed first.
        exc_type: qualified name of the remote exception type, or a description of how the
            process ended (e.g. ``"killed by signal 9 (SIGKILL)"``).
        remote_message: the remote exception's message.
        remote_traceback: the remote traceback as text (or the rank's last output lines).
        host: the address of the host the rank ran on ("" when unknown).
    """

    def __init__(self, rank: int, exc_type: str, remote_message: str, remote_traceback: str = "", host: str = ""):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.host = host
        where = f" on host {host}" if host else ""
        text = f"rank {rank}{where} failed with {exc_type}: {remote_message}"
        if remote_traceback:
            text += f"\n\nRemote traceback (rank {rank}):\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.remote_message, self.remote_traceback, self.host))


class JobTimeoutError(HvdSparkError):
    """A wait on other processes ran out of time. ``ranks`` lists the ranks (or tasks) that did not answer."""

    def __init__(self, message: str, ranks=()):
        self.ranks = list(ranks)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


class RankStalledError(JobTimeoutError):
    """Ranks made no progress for the job's ``stall_timeout`` (a hang, a stopped process, a collective
    that one rank never joins); the job was stopped, each rank having printed its stack.

    Attributes:
        ranks: the ranks without progress, the most likely culprit first (a stopped process, a rank
            outside the collective the others wait in, else the lowest progress count), then by
            progress count and silence.
        hosts: rank -> the address of its host.
    """

    def __init__(self, message: str, ranks=(), hosts: dict | None = None):
        self.hosts = {int(k): v for k, v in (hosts or {}).items()}
        super().__init__(message, ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.ranks, self.hosts))


class NotEnoughSlotsError(JobTimeoutError):
    """Elastic training had fewer task slots than ``min_num_proc`` for longer than ``elastic_timeout``.

    Attributes:
        slots: the task slots at the end of the wait.
        min_num_proc: the fewest ranks training goes on with.
    """

    def __init__(self, message: str, ranks=(), slots: int = 0, min_num_proc: int = 0):
        self.slots, self.min_num_proc = int(slots), int(min_num_proc)
        super().__init__(message, ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.ranks, self.slots, self.min_num_proc))


class RunInUseError(HvdSparkError):
    """Another fit is training the same ``run_id`` in the same store right now.

    Attributes:
        run_id: the run.
        holder: what the other fit's lease says: ``host``, ``pid``, ``started`` and ``heartbeat``
            (epoch seconds).
    """

    def __init__(self, message: str, run_id: str = "", holder: dict | None = None):
        self.run_id = run_id
        self.holder = dict(holder or {})
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.run_id, self.holder))
