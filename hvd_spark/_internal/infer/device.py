"""Where a UDF worker's model runs: the GPU Spark assigned to its task, or the CPU.

Runs in Spark's Python UDF workers; pyspark (``TaskContext``) and TensorFlow are imported only
when asked."""

import contextlib
import os

from hvd_spark._internal.common import settings

GPU_BATCH_SIZE = settings.GPU_BATCH_SIZE  # rows per model call on a GPU when batch_size was not set


def gpu_device(addresses: list[str] | None, cuda_visible: str | None) -> str | None:
    """TensorFlow's name for the first GPU Spark assigned to a task (``/GPU:<index>``), or None.

    TensorFlow numbers the GPUs it sees from 0: the physical id itself when ``CUDA_VISIBLE_DEVICES``
    is unset, else its position in that list (None when the assigned GPU is not in it)."""
    if not addresses:
        return None
    if cuda_visible is None:
        return f"/GPU:{int(addresses[0])}" if addresses[0].isdigit() else None
    visible = [v.strip() for v in cuda_visible.split(",") if v.strip()]
    return f"/GPU:{visible.index(addresses[0])}" if addresses[0] in visible else None


def task_device() -> str | None:
    """The TensorFlow device of this UDF's task: its Spark-assigned GPU, if any."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    try:
        info = ctx.resources().get("gpu") if ctx is not None else None
    except Exception:  # a Spark without task resources
        info = None
    return gpu_device(list(info.addresses) if info else None, os.environ.get("CUDA_VISIBLE_DEVICES"))


def on_device(device: str | None):
    """``tf.device(device)``, or nothing. Soft placement: without that GPU, TensorFlow uses the CPU."""
    if device is None:
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.device(device)
