"""TensorFlow's thread budget in a rank's process or a Python UDF worker."""

import contextlib
import os


def _positive(value: str | None) -> int | None:
    try:
        n = int(value) if value else 0
    except ValueError:
        return None
    return n if n > 0 else None


def thread_counts(num_threads: int | None, environ=None) -> tuple[int | None, int | None]:
    """(intra-op, inter-op) threads: ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` where
    the process's environment sets them (``backend_env`` on a rank, ``spark.executorEnv`` on a UDF
    worker), else ``num_threads`` for both."""
    env = os.environ if environ is None else environ
    n = num_threads or None
    return _positive(env.get("TF_NUM_INTRAOP_THREADS")) or n, _positive(env.get("TF_NUM_INTEROP_THREADS")) or n


def set_threads(num_threads: int | None, *, environment_wins: bool = False) -> None:
    """Applies ``num_threads`` to TensorFlow's intra- and inter-op pools (before any op runs); None
    or 0 leaves them as they are. ``environment_wins`` (a rank, whose environment hvd_spark wrote:
    its defaults, then the user's ``backend_env``): the environment's explicit counts win, each pool
    on its own (:func:`thread_counts`). Transform's Python workers keep ``num_threads``
    (``spark.task.cpus``): their environment is the executor's, not a setting of the job."""
    intra, inter = thread_counts(num_threads, None if environment_wins else {})
    if not intra and not inter:
        return
    import tensorflow as tf

    # RuntimeError: TF is already initialized; the environment variables the launcher set applied instead.
    with contextlib.suppress(RuntimeError):
        if intra:
            tf.config.threading.set_intra_op_parallelism_threads(intra)
        if inter:
            tf.config.threading.set_inter_op_parallelism_threads(inter)
