"""TensorFlow's thread budget in a rank's process or a Python UDF worker."""

import contextlib


def set_threads(num_threads: int | None) -> None:
    """Applies ``num_threads`` to TensorFlow's intra- and inter-op pools (before any op runs); None
    or 0 leaves them as they are."""
    if not num_threads:
        return
    import tensorflow as tf

    # RuntimeError: TF is already initialized; the environment variables the launcher set applied instead.
    with contextlib.suppress(RuntimeError):
        tf.config.threading.set_intra_op_parallelism_threads(int(num_threads))
        tf.config.threading.set_inter_op_parallelism_threads(max(1, int(num_threads)))
