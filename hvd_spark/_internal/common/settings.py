"""Named settings: environment variables, Spark conf keys and their defaults, in one place."""

import os

# Environment variables read by hvd_spark (names start with HVD_SPARK_).
ENV_START_TIMEOUT = "HVD_SPARK_START_TIMEOUT"  # seconds for all ranks to start
ENV_GLOO_TIMEOUT = "HVD_SPARK_GLOO_TIMEOUT"  # seconds for Gloo's rendezvous and collectives set-up
ENV_ABORT_GRACE = "HVD_SPARK_ABORT_GRACE"  # seconds ranks get to stop after an abort
ENV_MATERIALIZE_WAIT = "HVD_SPARK_MATERIALIZE_WAIT"  # seconds a fit waits for another fit writing the same data
ENV_PROGRESS = "HVD_SPARK_PROGRESS"  # 1 / 0: the fit's live progress bar on / off (default: on a TTY or notebook)
ENV_HEARTBEAT_TIMEOUT = "HVD_SPARK_HEARTBEAT_TIMEOUT"  # seconds of silence after which a task (or the driver) is lost
ENV_RUN_LEASE_STALE = "HVD_SPARK_RUN_LEASE_STALE"  # seconds after which a dead fit's lease on its run expires
ENV_WARM = "HVD_SPARK_WARM"  # 1 / 0: ranks forked by warm servers (default) / fresh processes
ENV_WARM_IDLE = "HVD_SPARK_WARM_IDLE"  # seconds an idle warm server lives (default 600)
ENV_STALL_TIMEOUT = "HVD_SPARK_STALL_TIMEOUT"  # seconds without a rank's progress before the job is stopped
ENV_EXECUTOR_WAIT = "HVD_SPARK_EXECUTOR_WAIT"  # seconds a launch waits for the application's executors to register

# Set by the launcher in each rank's process (read by hvd_spark's worker side).
ENV_DRIVER_ADDR = "HVD_SPARK_DRIVER_ADDR"
ENV_JOB_TOKEN = "HVD_SPARK_JOB_TOKEN"
ENV_RANK = "HVD_SPARK_RANK"
ENV_HOST = "HVD_SPARK_HOST"  # the address of the rank's host (its task's address towards the driver)

# Spark conf keys (spark.hvd_spark.*), read on the driver; the environment wins over them.
CONF_START_TIMEOUT = "spark.hvd_spark.startTimeout"
CONF_EXECUTOR_WAIT = "spark.hvd_spark.executorWait"

DEFAULT_START_TIMEOUT = 600.0
DEFAULT_EXECUTOR_WAIT = 30.0  # never longer than start_timeout
EXECUTORS_SETTLE = 5.0  # seconds a standalone application's executor count must hold still to count as complete
DEFAULT_GLOO_TIMEOUT = 120.0
DEFAULT_ABORT_GRACE = 10.0
DEFAULT_MATERIALIZE_WAIT = 3600.0
HEARTBEAT_INTERVAL = 5.0  # seconds between heartbeats, driver to tasks and tasks to driver
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
DEFAULT_FIT_STALL_TIMEOUT = 300.0  # a fit's ranks tick on every step; run()'s functions tick when they choose
PROGRESS_INTERVAL = 1.0  # seconds between a rank's progress messages (only when its count moved)
MIN_STALL_TIMEOUT = 5.0
LEASE_HEARTBEAT = 10.0  # seconds between a lease's heartbeats (a writer in progress on the store)
LEASE_STALE = 60.0  # a lease whose heartbeat is older than this belongs to a writer that is gone
STOP_WAIT = 30.0  # seconds a failed or cancelled job waits for its ranks' processes to exit before it returns

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, value: str) -> bool:
    """Parses a boolean setting strictly; anything but the usual spellings is an error."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {sorted(_TRUE | _FALSE)}. Received: {value!r}.")


def parse_seconds(name: str, value) -> float:
    """Parses a positive number of seconds, naming the setting in the error."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds. Received: {value!r}.") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be greater than 0 seconds. Received: {value!r}.")
    return seconds


def seconds_setting(explicit, env_name: str, conf_value, default: float, param: str) -> float:
    """Resolves a timeout: the explicit argument, else the environment, else Spark conf, else default."""
    if explicit is not None:
        return parse_seconds(param, explicit)
    if os.environ.get(env_name):
        return parse_seconds(env_name, os.environ[env_name])
    if conf_value:
        return parse_seconds(param, conf_value)
    return default


def run_lease_stale() -> float:
    """Seconds after its last heartbeat that a fit's lease on its run expires (a fit that died)."""
    return max(2 * LEASE_HEARTBEAT, seconds_setting(None, ENV_RUN_LEASE_STALE, None, LEASE_STALE, "run_lease_stale"))


def warm_default() -> bool:
    """Whether launches use warm servers unless told otherwise (``HVD_SPARK_WARM``, default on)."""
    value = os.environ.get(ENV_WARM, "")
    return parse_bool(ENV_WARM, value) if value else True


def stall_timeout_setting(explicit, default: float | None) -> float | None:
    """A job's ``stall_timeout``: the explicit value (0 turns the watchdog off), else
    ``HVD_SPARK_STALL_TIMEOUT`` (0: off), else ``default`` (None: off)."""
    value = explicit if explicit is not None else os.environ.get(ENV_STALL_TIMEOUT) or None
    if value is None:
        return default
    name = "stall_timeout" if explicit is not None else ENV_STALL_TIMEOUT
    if not isinstance(value, str) and (isinstance(value, bool) or not isinstance(value, int | float)):
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
