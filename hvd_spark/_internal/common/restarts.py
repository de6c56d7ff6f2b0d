"""The restart policy of a fit: which failed training attempts start again, from the latest checkpoint."""

from hvd_spark._internal.common.outcomes import HOST_UNREACHABLE, TASK_LOST
from hvd_spark.errors import (
    DamagedFileError,
    DataChangedError,
    ExecutorPythonError,
    JobDeadlineError,
    JobTimeoutError,
    LaunchError,
    RankFailedError,
)

# Failures of the distributed job itself: a rank that raised or whose process died, tasks that did
# not start or a launch that broke, a job past its timeout. A new attempt may succeed (a lost
# executor, a killed process). Errors on the driver (bad input, a bug) are not retried.
RESTARTABLE = (RankFailedError, LaunchError, JobTimeoutError)

# Failure types that mean a rank's host (or its executor) went away, not that the rank's code failed.
LOST_HOST_TYPES = (TASK_LOST, HOST_UNREACHABLE)


def should_restart(error: BaseException, restarts_so_far: int, max_restarts: int) -> bool:
    """Whether the fit starts another training attempt after ``error``.

    Args:
        error: what the attempt raised.
        restarts_so_far: attempts already restarted in this fit.
        max_restarts: the estimator's ``max_restarts`` (0: never).
    """
    if isinstance(error, RankFailedError) and any(error.raised(t) for t in (DataChangedError, DamagedFileError)):
        return False  # a file changed or damaged under the fit: another attempt would read the same bytes
    if isinstance(error, JobDeadlineError):
        return False  # the whole job's time is spent: another attempt would have none
    if isinstance(error, ExecutorPythonError):
        return False  # every attempt would meet the same Python
    return isinstance(error, RESTARTABLE) and restarts_so_far < max_restarts
