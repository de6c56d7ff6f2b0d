"""Every knob of hvd_spark, declared once: its environment variable, Spark conf key, type, default,
where it is read and what it does. ``docs/settings.md`` holds the table made from these declarations
(:func:`markdown_table`; a fast test keeps the two equal). To refresh the docs after a change:
``python -c "from hvd_spark._internal.common import settings; print(settings.markdown_table())"``.

Precedence, the same for every setting: an explicit argument (``run(warm=...)``, ``start_timeout=``)
always wins, then the environment variable, then the ``spark.hvd_spark.*`` conf key, then the default.
One parser per type: a boolean is written ``1`` / ``0`` (or true / false, yes / no, on / off).

Three kinds of names live here:

* :class:`Setting`: a knob a user sets (environment, Spark conf, sometimes an argument);
* :class:`Fixed`: a value hvd_spark keeps fixed on purpose, declared here so it is defined once
  (two processes must agree on it, or it is tied to another timing rule);
* :class:`Internal`: environment variables hvd_spark itself sets for a rank's process.
"""

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, value) -> bool:
    """Parses a boolean setting strictly; anything but the usual spellings is an error."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {sorted(_TRUE | _FALSE)}. Received: {value!r}.")


def parse_seconds(name: str, value) -> float:
    """Parses a positive number of seconds, naming the setting in the error."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds. Received: {value!r}.")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds. Received: {value!r}.") from None
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{name} must be greater than 0 seconds (and finite). Received: {value!r}.")
    return seconds


def parse_count(name: str, value) -> int:
    """Parses a positive whole number (a count, a size in bytes), naming the setting in the error."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer. Received: {value!r}.")
    try:
        number = int(str(value).strip()) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{name} must be a positive integer. Received: {value!r}.") from None
    if not isinstance(number, int) or number < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {value!r}.")
    return number


def parse_count_or_off(name: str, value) -> int:
    """Parses a count or a size in bytes that may be 0 (the feature it bounds is off)."""
    try:
        zero = not isinstance(value, bool) and int(str(value).strip()) == 0
    except ValueError:
        zero = False
    if zero:
        return 0
    try:
        return parse_count(name, value)
    except ValueError:
        raise ValueError(f"{name} must be 0 (off) or a positive integer. Received: {value!r}.") from None


MIN_STALL_TIMEOUT = 5.0
PROGRESS_INTERVAL = 1.0  # defined here (not below) because the stall parser's message names it


def parse_stall_timeout(name: str, value) -> float | None:
    """Parses a stall timeout: 0 turns the watchdog off (None), else at least ``MIN_STALL_TIMEOUT``."""
    if not isinstance(value, str) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"{name} must be a number of seconds (0: no stall watchdog). Received: {value!r}.")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds (0: no stall watchdog). Received: {value!r}.") from None
    if seconds != 0 and not seconds >= MIN_STALL_TIMEOUT:
        raise ValueError(
            f"{name} must be 0 (no stall watchdog) or at least {MIN_STALL_TIMEOUT:g} seconds (ranks report "
            f"progress every {PROGRESS_INTERVAL:g} s). Received: {value!r}."
        )
    return seconds or None


LAYOUTS = ("host", "slot")


def parse_layout(name: str, value) -> str:
    """Parses a rank layout: ``host`` (a host's cores train one rank) or ``slot`` (one rank per task slot)."""
    v = str(value).strip().lower() if isinstance(value, str) else value
    if v not in LAYOUTS:
        raise ValueError(f"{name} must be one of {list(LAYOUTS)}. Received: {value!r}.")
    return v


# type name (in the docs) -> parser(name, value)
PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "bool": parse_bool,
    "seconds": parse_seconds,
    "count": parse_count,
    "bytes": parse_count,
    "bytes (0: off)": parse_count_or_off,
    "count (0: off)": parse_count_or_off,
    "seconds (0: off)": parse_stall_timeout,
    "path": lambda name, value: str(value),
    "host or slot": parse_layout,
}

_NO: Any = object()  # no default given
WHERE = ("driver", "task", "rank")  # the processes a setting can be read in

SETTINGS: list["Setting"] = []
FIXED: list["Fixed"] = []
INTERNAL: list["Internal"] = []


@dataclasses.dataclass(frozen=True)
class Setting:
    """A knob a user sets. ``argument`` is the public argument or Param that sets it explicitly,
    where there is one (errors about an explicit value name it; else ``name``). ``where`` lists the
    processes that read it (the environment of that process counts; Spark conf is only read on the
    driver). ``type`` picks the one parser of :data:`PARSERS` for every source."""

    name: str
    env: str
    conf: str | None
    type: str
    default: Any
    where: tuple[str, ...]
    doc: str
    argument: str | None = None  # the public argument or Param that sets it explicitly

    def __post_init__(self):
        if self.type not in PARSERS:
            raise ValueError(f"type must be one of {sorted(PARSERS)}. Received: {self.type!r} for {self.name}.")
        if not self.env.startswith("HVD_SPARK_"):
            raise ValueError(f"env must start with HVD_SPARK_. Received: {self.env!r} for {self.name}.")
        if self.conf is not None and not self.conf.startswith("spark.hvd_spark."):
            raise ValueError(f"conf must start with spark.hvd_spark. Received: {self.conf!r} for {self.name}.")
        if not set(self.where) <= set(WHERE):
            raise ValueError(f"where must name processes of {WHERE}. Received: {self.where!r} for {self.name}.")
        if self.conf is not None and "driver" not in self.where:
            raise ValueError(f"{self.name}: a Spark conf key is only read on the driver")

    def parse(self, name: str, value) -> Any:
        return PARSERS[self.type](name, value)

    def get(
        self, explicit: Any = None, *, env: Mapping[str, str] | None = None, conf: Any = None, default: Any = _NO
    ) -> Any:
        """The setting's value: ``explicit`` (not None), else ``env`` (default: this process's
        environment), else ``conf`` (anything with ``get(key, default)``: the application's Spark
        conf, on the driver), else ``default`` (the declared one unless given). A bad value is an
        error naming where it came from (the argument, the variable or the conf key)."""
        if explicit is not None:
            return self.parse(self.argument or self.name, explicit)
        raw = (os.environ if env is None else env).get(self.env)
        if raw is not None and str(raw).strip():
            return self.parse(self.env, raw)
        if conf is not None and self.conf is not None:
            raw = conf.get(self.conf, None)
            if raw is not None and str(raw).strip():
                return self.parse(self.conf, raw)
        return self.default if default is _NO else default


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A value hvd_spark keeps fixed, with the reason it is not a setting."""

    name: str
    value: Any
    where: tuple[str, ...]
    doc: str


@dataclasses.dataclass(frozen=True)
class Internal:
    """An environment variable hvd_spark sets for a rank's process (not a setting: do not set it)."""

    env: str
    set_by: str
    doc: str


def _setting(*args, **kwargs) -> Setting:
    s = Setting(*args, **kwargs)
    SETTINGS.append(s)
    return s


def _fixed(name: str, value, where: tuple[str, ...], doc: str):
    FIXED.append(Fixed(name, value, where, doc))
    return value


def _internal(env: str, set_by: str, doc: str) -> str:
    INTERNAL.append(Internal(env, set_by, doc))
    return env


# --- Settings -----------------------------------------------------------------------------------

START_TIMEOUT = _setting(
    "start_timeout", "HVD_SPARK_START_TIMEOUT", "spark.hvd_spark.startTimeout", "seconds", 600.0, ("driver",),
    "Seconds for all barrier tasks of a job to start (Spark must schedule them all at once).",
    argument="start_timeout",
)  # fmt: skip
EXECUTOR_WAIT = _setting(
    "executor_wait", "HVD_SPARK_EXECUTOR_WAIT", "spark.hvd_spark.executorWait", "seconds", 30.0, ("driver",),
    "Seconds a launch on a cluster master waits for the application's executors to register "
    "(never longer than `start_timeout`).",
)  # fmt: skip
GLOO_TIMEOUT = _setting(
    "gloo_timeout", "HVD_SPARK_GLOO_TIMEOUT", "spark.hvd_spark.glooTimeout", "seconds", 120.0, ("driver",),
    "Seconds for Gloo's rendezvous and connections (`HOROVOD_GLOO_TIMEOUT_SECONDS` of the ranks).",
)  # fmt: skip
ABORT_GRACE = _setting(
    "abort_grace", "HVD_SPARK_ABORT_GRACE", "spark.hvd_spark.abortGrace", "seconds", 10.0, ("driver",),
    "Seconds ranks get between SIGTERM and SIGKILL when a job is stopped.",
)  # fmt: skip
HEARTBEAT_TIMEOUT = _setting(
    "heartbeat_timeout", "HVD_SPARK_HEARTBEAT_TIMEOUT", "spark.hvd_spark.heartbeatTimeout", "seconds", 30.0,
    ("driver",),
    "Seconds without a heartbeat after which a task's host (or, seen from a task, the driver) is lost "
    "(at least twice the heartbeat interval).",
)  # fmt: skip
STALL_TIMEOUT = _setting(
    "stall_timeout", "HVD_SPARK_STALL_TIMEOUT", "spark.hvd_spark.stallTimeout", "seconds (0: off)", None,
    ("driver",),
    "Seconds without any rank's progress before the job is stopped as stalled; 0 or unset: no "
    "watchdog for `run`, 300 s for a fit (`stall_timeout` Param).",
    argument="stall_timeout",
)  # fmt: skip
FIRST_STEP_TIMEOUT = _setting(
    "first_step_timeout", "HVD_SPARK_FIRST_STEP_TIMEOUT", None, "seconds", 1800.0, ("rank",),
    "Seconds a rank's first training step (Keras tracing and compiling the train step) counts as "
    "progress for the stall watchdog; a first step still running after that is caught `stall_timeout` "
    "seconds later.",
)  # fmt: skip
ELASTIC_TIMEOUT = _setting(
    "elastic_timeout", "HVD_SPARK_ELASTIC_TIMEOUT", "spark.hvd_spark.elasticTimeout", "seconds", 600.0, ("driver",),
    "Elastic training (`min_num_proc`): seconds with fewer task slots than `min_num_proc` before the fit "
    "or `run` fails with `NotEnoughSlotsError`.",
    argument="elastic_timeout",
)  # fmt: skip
ELASTIC_POLL = _setting(
    "elastic_poll", "HVD_SPARK_ELASTIC_POLL", None, "seconds", 2.0, ("driver",),
    "Elastic training: seconds between counts of the task slots, while waiting for `min_num_proc` of "
    "them and while a job runs on fewer than it could (training grows at the next epoch end).",
)  # fmt: skip
DATA_TRACE = _setting(
    "data_trace", "HVD_SPARK_DATA_TRACE", None, "path", None, ("rank",),
    "A folder on the rank's host: each rank of a fit appends, for every training batch its reader "
    "yields, the epoch, the step and the first feature column's values (as JSON lines, one file per "
    "rank process). For proving which rows were trained (the elastic tests); costs a write per batch.",
)  # fmt: skip
SPARSE_AS_DENSE = _setting(
    "sparse_as_dense", "HVD_SPARK_SPARSE_AS_DENSE", None, "bool", False, ("rank",),
    "1: a fit's ranks reduce an `IndexedSlices` gradient (an `Embedding`'s) as a dense tensor of the whole "
    "table (Horovod's `sparse_as_dense`): fewer bytes when a step looks up more rows than the table has "
    "(gathered, the rows of all ranks arrive at every rank), but the optimizer then takes its dense update, "
    "not plain Keras' at the global batch. Set it with `backend_env`. 0: gathered as `IndexedSlices`.",
)  # fmt: skip
WARM = _setting(
    "warm", "HVD_SPARK_WARM", "spark.hvd_spark.warm", "bool", True, ("driver", "task"),
    "Ranks forked by the host's warm server (Gloo, no GPUs); 0: fresh processes. Read on the driver "
    "(a job's `env` entry counts as its environment); the task follows the driver's decision, and "
    "reads its executor's own variable only when the driver had none of these. Also transform's: on, "
    "its CPU workers predict in children of a warm server of the application when one can serve them.",
    argument="warm",
)  # fmt: skip
RANK_LAYOUT = _setting(
    "rank_layout", "HVD_SPARK_RANK_LAYOUT", "spark.hvd_spark.rankLayout", "host or slot", "host", ("driver",),
    "How a fit's ranks use a host's cores when `num_proc` is not given. `host`: one rank per executor "
    "(per machine on a `local` master) with TensorFlow's threads on all its cores: a barrier task "
    "that asks for the executor's cores through stage-level scheduling where Spark has it (a "
    "`TaskResourceProfile`: standalone and `local-cluster` on Spark >= 3.4, YARN and Kubernetes on >= "
    "3.5, dynamic allocation off); elsewhere one rank per task slot, with `spark.task.cpus` threads. "
    "`slot`: one rank per task slot (horovod.spark's layout; `hvd_spark.run`'s default). With `num_proc` "
    "given, a rank's threads are the cores of its host divided among the ranks there (`host`) or "
    "`spark.task.cpus` (`slot`). See docs/cluster.md, \"Laying ranks out\".",
)  # fmt: skip
WARM_IDLE = _setting(
    "warm_idle", "HVD_SPARK_WARM_IDLE", None, "seconds", 600.0, ("task",),
    "Seconds an idle warm server lives (the task's environment, with the job's `env`).",
)  # fmt: skip
WARM_START_TIMEOUT = _setting(
    "warm_start_timeout", "HVD_SPARK_WARM_START_TIMEOUT", None, "seconds", 120.0, ("task",),
    "Seconds a warm server may take to import TensorFlow, Keras and Horovod (3-5 s on an idle machine): "
    "past them it ends, and a task that waited as long for it starts its rank cold, with the warning "
    "`warm server ... not ready` on the driver (the task's environment, with the job's `env`).",
)  # fmt: skip
PROGRESS = _setting(
    "progress", "HVD_SPARK_PROGRESS", None, "bool", None, ("driver",),
    "The fit's live progress bar on / off; unset: on when stderr is a TTY or in a notebook.",
)  # fmt: skip
MLFLOW_TIMEOUT = _setting(
    "mlflow_timeout", "HVD_SPARK_MLFLOW_TIMEOUT", None, "seconds", 30.0, ("driver",),
    "Seconds a fit waits for MLflow when it starts its tracking (the run, params, tags) and at its end "
    "(the epochs not logged yet, the summary, the model, ending the run); past them it goes on untracked, "
    "or returns its model, with a warning naming what was not logged. Epochs never wait: they are queued "
    "for the tracker's own thread. A large model logged to a slow artifact store may need more.",
)  # fmt: skip
MATERIALIZE_WAIT = _setting(
    "materialize_wait", "HVD_SPARK_MATERIALIZE_WAIT", None, "seconds", 3600.0, ("driver",),
    "Seconds a fit waits for another fit that writes the same data to the store, before writing it itself.",
)  # fmt: skip
RUN_LEASE_STALE = _setting(
    "run_lease_stale", "HVD_SPARK_RUN_LEASE_STALE", None, "seconds", 60.0, ("driver",),
    "Seconds after its last heartbeat that a fit's lease on its run expires, so another fit may take "
    "the run over (at least twice the lease heartbeat).",
)  # fmt: skip
STOP_WAIT = _setting(
    "stop_wait", "HVD_SPARK_STOP_WAIT", None, "seconds", 30.0, ("driver",),
    "Seconds a failed or cancelled job waits for its ranks' processes to exit before it returns.",
)  # fmt: skip
MAX_FILES = _setting(
    "max_files", "HVD_SPARK_MAX_FILES", None, "count", 256, ("driver",),
    "Parquet files per split of materialized data at most (unless `num_proc` is larger).",
)  # fmt: skip
ROW_GROUP_BYTES = _setting(
    "row_group_bytes", "HVD_SPARK_ROW_GROUP_BYTES", "spark.hvd_spark.rowGroupBytes", "bytes", 64 * 1024 * 1024,
    ("driver",),
    "Bytes of a Parquet row group of the materialized data, by either writer: a writer holds one in "
    "memory, and a rank reads one whole.",
)  # fmt: skip
LOCAL_COPY_BYTES = _setting(
    "local_copy_bytes", "HVD_SPARK_LOCAL_COPY_BYTES", "spark.hvd_spark.localCopyBytes", "bytes (0: off)",
    64 * 1024 * 1024, ("driver",),
    "A DataFrame made on the driver (a local relation, e.g. from pandas) of at most this many bytes (4 a "
    "value, 64 a string) is copied to the store by the driver itself, not by a Spark job of Parquet "
    "writers; 0 always uses the Spark job.",
)  # fmt: skip
DRIVER_TRANSFORM_ROWS = _setting(
    "driver_transform_rows", "HVD_SPARK_DRIVER_TRANSFORM_ROWS", "spark.hvd_spark.driverTransformRows",
    "count (0: off)", 10_000, ("driver",),
    "`transform` of a DataFrame made on the driver (a local relation, e.g. from pandas), or of a cached one "
    "whose cache is filled (of at most `HVD_SPARK_LOCAL_COPY_BYTES`), of at most this many rows is predicted "
    "by the driver, with the model loaded there once, instead of Spark's Python UDF workers; 0 always uses "
    "the UDF.",
)  # fmt: skip
KEEP_VALIDATION_BYTES = _setting(
    "keep_validation_bytes", "HVD_SPARK_KEEP_VALIDATION_BYTES", None, "bytes (0: off)", 64 * 1024 * 1024,
    ("rank",),
    "A rank's validation rows of at most this many bytes (decoded: Keras' input tensors, torch's arrays) are "
    "read once, at the first validation, and kept in its memory: later epochs' validations read no file. 0 "
    "reads them at every validation, as does a fit with a `transformation_fn`.",
)  # fmt: skip
STORE_RETRY_WINDOW = _setting(
    "store_retry_window", "HVD_SPARK_STORE_RETRY_WINDOW", None, "seconds", 120.0, ("driver", "rank"),
    "Seconds an operation on the store (checkpoints, listings, leases, the final model, a rank's reads "
    "of the data) is retried while it fails with transient errors (connection refused or reset, "
    "timeouts, 5xx, throttling), with backoff; past it the fit fails with `StoreUnavailableError` "
    "(or restarts, `max_restarts`). The ranks use the driver's value (or the `Store`'s `retry_window`).",
)  # fmt: skip
MPI_CONNECT_TIMEOUT = _setting(
    "mpi_connect_timeout", "HVD_SPARK_MPI_CONNECT_TIMEOUT", None, "seconds", 30.0, ("task",),
    "Seconds for mpirun's agent to reach a host's command server (`backend='mpi'`).",
)  # fmt: skip

# Names used in messages (the same strings as the declarations above).
ENV_START_TIMEOUT, CONF_START_TIMEOUT = START_TIMEOUT.env, str(START_TIMEOUT.conf)
ENV_EXECUTOR_WAIT, CONF_EXECUTOR_WAIT = EXECUTOR_WAIT.env, str(EXECUTOR_WAIT.conf)
ENV_HEARTBEAT_TIMEOUT = HEARTBEAT_TIMEOUT.env
ENV_STALL_TIMEOUT = STALL_TIMEOUT.env
ENV_RUN_LEASE_STALE = RUN_LEASE_STALE.env
ENV_PROGRESS = PROGRESS.env
ENV_WARM, ENV_WARM_IDLE = WARM.env, WARM_IDLE.env

# --- Fixed values -------------------------------------------------------------------------------

HEARTBEAT_INTERVAL = _fixed(
    "heartbeat_interval", 5.0, ("driver", "task"),
    "Seconds between heartbeats, driver to tasks and tasks to driver. Fixed: both ends must agree.",
)  # fmt: skip
_fixed(
    "progress_interval", PROGRESS_INTERVAL, ("rank",),
    "Seconds between a rank's progress messages (only when its count moved). Fixed: the stall "
    "watchdog's minimum (5 s) is made from it.",
)  # fmt: skip
_fixed(
    "min_stall_timeout", MIN_STALL_TIMEOUT, ("driver",),
    "The smallest stall timeout accepted (a few progress intervals).",
)  # fmt: skip
DEFAULT_FIT_STALL_TIMEOUT = _fixed(
    "fit_stall_timeout", 300.0, ("driver",),
    "The estimator's `stall_timeout` default (a fit's ranks report every step); `run` has none.",
)  # fmt: skip
LEASE_HEARTBEAT = _fixed(
    "lease_heartbeat", 10.0, ("driver",),
    "Seconds between a store lease's heartbeats (a writer or reader of materialized data, a run's "
    "fit). Fixed: every fit that shares a store must agree.",
)  # fmt: skip
LEASE_STALE = _fixed(
    "lease_stale", 60.0, ("driver",),
    "Seconds after which a data lease whose heartbeat stopped belongs to a fit that is gone. Fixed: "
    "every fit that shares a store must agree.",
)  # fmt: skip
EXECUTORS_SETTLE = _fixed(
    "executors_settle", 5.0, ("driver",),
    "Seconds a standalone application's executor count must hold still to count as complete.",
)  # fmt: skip
CANCEL_AFTER = _fixed(
    "cancel_after", 10.0, ("driver",),
    "Seconds past `abort_grace` after which tasks that ignore an abort are cancelled through Spark.",
)  # fmt: skip
GIVE_UP_AFTER = _fixed(
    "give_up_after", 70.0, ("driver",),
    "Seconds past `abort_grace` after which a job that ignores its cancellation is no longer waited for "
    "(tied to `cancel_after`).",
)  # fmt: skip
PROGRESS_BATCH_INTERVAL = _fixed(
    "progress_batch_interval", 0.5, ("rank",),
    "Seconds between rank 0's in-epoch events while the live progress bar is shown.",
)  # fmt: skip
TAIL_LINES = _fixed(
    "tail_lines", 40, ("task",),
    "Last output lines of a failed rank kept in its error.",
)  # fmt: skip
CHANNEL_FLUSH_INTERVAL = _fixed(
    "channel_flush_interval", 1.0, ("driver",),
    "Seconds between two files of a live channel (Spark Connect: ranks' output and events).",
)  # fmt: skip
MAX_KEPT_LINES = _fixed(
    "max_kept_lines", 5000, ("driver",),
    "Rank output lines kept per rank when there is no store to write them to.",
)  # fmt: skip
GPU_BATCH_SIZE = _fixed(
    "gpu_batch_size", 32768, ("task",),
    "Rows per model call of `transform` on a GPU when `batch_size` was not set.",
)  # fmt: skip

# --- Internal: set by hvd_spark for the processes it starts ------------------------------------

ENV_DRIVER_ADDR = _internal("HVD_SPARK_DRIVER_ADDR", "task", "The driver service's `host:port`, for a rank's events.")
ENV_JOB_TOKEN = _internal("HVD_SPARK_JOB_TOKEN", "task", "The job's secret for the driver service.")
ENV_RANK = _internal("HVD_SPARK_RANK", "task", "The rank's number (also read by your code).")
ENV_HOST = _internal("HVD_SPARK_HOST", "task", "The address of the rank's host (its task's address to the driver).")
ENV_WORKDIR = _internal("HVD_SPARK_WORKDIR", "task", "The task's folder: a rank's payload and result.")
ENV_RANK_STARTED = _internal("HVD_SPARK_RANK_STARTED", "task", "When the task started the rank (its start-up profile).")
ENV_WARM_RANK = _internal("HVD_SPARK_WARM_RANK", "warm server", "1 in a rank forked by a warm server.")
ENV_MPI_HOSTS = _internal("HVD_SPARK_MPI_HOSTS", "task", "`{host: addr:port}` of every host's MPI command server.")
ENV_NODE_SIZES = _internal("HVD_SPARK_NODE_SIZES", "task", "An MPI job's ranks per host (torch's variables).")
ENV_NUM_THREADS = _internal("HVD_SPARK_NUM_THREADS", "task", "The rank's thread count (`num_threads`), for your code.")
ENV_GPUS = _internal("HVD_SPARK_GPUS", "task", "The task's GPU addresses, for your code (`use_gpu`).")


def environ(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``overrides`` (a job's ``env``) on top."""
    return {**os.environ, **(overrides or {})}


def run_lease_stale() -> float:
    """Seconds after its last heartbeat that a fit's lease on its run expires (a fit that died)."""
    return max(2 * LEASE_HEARTBEAT, RUN_LEASE_STALE.get())


def stall_timeout_setting(explicit, default: float | None, conf: Any = None) -> float | None:
    """A job's ``stall_timeout``: the explicit value (0 turns the watchdog off), else
    ``HVD_SPARK_STALL_TIMEOUT`` or its conf key (0: off), else ``default`` (None: off)."""
    return STALL_TIMEOUT.get(explicit, conf=conf, default=default)


# --- The table in docs/settings.md ----------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


def markdown_table() -> str:
    """The settings, fixed values and internal variables as the Markdown tables of docs/settings.md."""
    lines = [
        "| environment variable | Spark conf key | type | default | read on | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        default = _cell(s.default) if s.default is not None else "unset"
        env = f"`{s.env}`" + (f" (argument: `{s.argument}`)" if s.argument else "")
        conf = f"`{s.conf}`" if s.conf else "-"
        lines.append(f"| {env} | {conf} | {s.type} | {default} | {', '.join(s.where)} | {s.doc} |")
    lines += ["", "| fixed value | value | used on | what it is |", "| --- | --- | --- | --- |"]
    for f in FIXED:
        lines.append(f"| `{f.name}` | {_cell(f.value)} | {', '.join(f.where)} | {f.doc} |")
    lines += ["", "| internal variable | set by | what it holds |", "| --- | --- | --- |"]
    for i in INTERNAL:
        lines.append(f"| `{i.env}` | {i.set_by} | {i.doc} |")
    return "\n".join(lines) + "\n"
