"""Errors raised by hvd_spark at run time.

Argument problems raise the built-in ``ValueError`` / ``TypeError``. Failures of a running
job raise a subclass of :class:`HvdSparkError`; each is picklable, since errors cross the
executor / driver boundary.
"""


class HvdSparkError(RuntimeError):
    """Base class of hvd_spark's run-time errors."""


class InvalidFeatureError(ValueError):
    """A feature value ``transform`` cannot give the model (``handleInvalid="error"``): a null, an array
    with a null element, a NaN or an infinity, or a value that does not fit the model's input. Raised
    inside Spark's Python UDF workers; its message is the first line after Spark's ``An exception was
    thrown from the Python worker:`` (on pyspark >= 4.0; on 3.5 after a one-frame traceback)."""


class DataChangedError(HvdSparkError):
    """A file of a table read in place (``materialize="auto"`` / ``"never"``) was removed or changed
    (size, modification time, rows) after the fit listed it: the fit stops instead of training on
    half-old, half-new data. Never restarted: fit again to train on the table as it is now."""


class DamagedFileError(HvdSparkError):
    """A rank could not decode a Parquet file of its training data (a table read in place, or the store's
    copy) although the file still has the size and modification time the fit listed: its bytes were
    damaged in place (a disk or copy fault, a restored backup) or it was written badly. The message's
    first line names the file and the row group. Never restarted: another attempt reads the same bytes."""


class StoreUnavailableError(HvdSparkError):
    """An operation on the store kept failing with transient errors (connection refused or reset,
    timeouts, 5xx answers, throttling) for longer than the retry window (``store_retry_window``).
    Inside a rank it fails the rank, and the fit restarts when ``max_restarts`` allows.

    Attributes:
        store: the store's URL (without credentials).
        operation: what hvd_spark was doing (``"listing the checkpoints of run r1"``).
        cause: the last error, on one line.
        seconds: how long it was tried; ``tries``: how many times.
    """

    def __init__(self, store: str, operation: str, cause: str, seconds: float = 0.0, tries: int = 0, window=0.0):
        self.store, self.operation, self.cause = store, operation, cause
        self.seconds, self.tries, self.window = float(seconds), int(tries), float(window)
        super().__init__(
            f"store {store}: {operation} failed: {cause} (tried {self.tries} times over {self.seconds:.0f}s; the "
            f"retry window is {self.window:g}s, HVD_SPARK_STORE_RETRY_WINDOW)"
        )

    def __reduce__(self):
        return (type(self), (self.store, self.operation, self.cause, self.seconds, self.tries, self.window))


class DataPreparationError(HvdSparkError):
    """A Spark job that a fit runs on the driver to prepare its data failed: writing the training data
    to the store, scanning a table read in place, listing the input files, computing statistics.

    The first line of the message is ``"<what hvd_spark was doing>: <root cause>"``: the store's URL
    (without credentials) where the job writes to it, then the innermost Java exception (``java.io.
    IOException: No space left on device``) or the Python exception raised on an executor, a UDF of
    yours included, with the function, file and line that raised it. Spark's own error, with its stack
    traces, is the ``__cause__``. Never restarted (``max_restarts`` covers training).

    Attributes:
        what: what hvd_spark was doing.
        root_cause: the innermost cause, one line.
    """

    def __init__(self, message: str, what: str = "", root_cause: str = ""):
        self.what = what
        self.root_cause = root_cause
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.what, self.root_cause))


class LaunchError(HvdSparkError):
    """The Horovod job could not be started or was lost (tasks not scheduled, not answering)."""


class ExecutorPythonError(LaunchError):
    """The Spark executors' Python cannot run hvd_spark: it cannot import hvd_spark (or what hvd_spark
    needs), or it has another version of hvd_spark than the driver. Found by the short job a fit
    starts with its checks (before any data is written), or from the barrier stage's failure of
    ``hvd_spark.run``. Never restarted: every attempt would meet the same Python.

    The fix: ``PYSPARK_PYTHON`` (or ``spark.pyspark.python``) set, before the session starts, to a
    Python with this hvd_spark installed (the driver's own on one machine), or a session from
    ``hvd_spark.local_session()``, which sets it.

    Attributes:
        python: the executors' Python ("" when it did not start).
        problem: what failed there, one line (``"ModuleNotFoundError: No module named 'hvd_spark'"``).
        driver_version / executor_version: hvd_spark's versions ("" when not known).
    """

    def __init__(self, python: str, problem: str, driver_version: str = "", executor_version: str = ""):
        self.python, self.problem = python, problem
        self.driver_version, self.executor_version = driver_version, executor_version
        where = f" ({python})" if python else ""
        wanted = f"hvd_spark {driver_version}" if driver_version else "hvd_spark"
        super().__init__(
            f"The Spark executors' Python{where} cannot run hvd_spark's tasks: {problem}. Set PYSPARK_PYTHON (or "
            f"spark.pyspark.python) before the SparkSession starts to a Python with {wanted} installed (the "
            "driver's, on one machine), or use hvd_spark.local_session(), which does."
        )

    def __reduce__(self):
        return (type(self), (self.python, self.problem, self.driver_version, self.executor_version))


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

    def raised(self, error_type: type[BaseException]) -> bool:
        """Whether the rank's code raised an ``error_type``: the rank's own exception (this error's
        ``__cause__``, when it unpickled on the driver) is one, or its type is that very class (by its
        qualified name: an error that crossed a process without its exception object)."""
        if isinstance(self.__cause__, error_type):
            return True
        return self.exc_type == f"{error_type.__module__}.{error_type.__qualname__}"


class JobTimeoutError(HvdSparkError):
    """A wait on other processes ran out of time. ``ranks`` lists the ranks (or tasks) that did not answer."""

    def __init__(self, message: str, ranks=()):
        self.ranks = list(ranks)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


class JobDeadlineError(JobTimeoutError):
    """The job ran past its whole-job ``timeout``: never restarted (the time was the caller's to give;
    ``max_restarts`` more attempts would take it again each), unlike tasks that did not start in time or a
    stall. ``ranks``: those that had not finished."""


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
