"""Gradient averaging for Keras 3 optimizers over Horovod ranks.

``horovod.tensorflow.keras`` does not work with Keras 3 (its optimizer wrapper touches
``Variable.ref``, which Keras 3 variables lack). Here the optimizer instance gets a subclass of its
own class that averages the gradients of each update with one ``hvd.grouped_allreduce``
(:func:`make_distributed`); :func:`plain_class` gives it back its original class while it is saved.
"""

import contextlib

import keras
import tensorflow as tf

from hvd_spark._internal.common import internals

_DIST_ATTR = "_hvd_spark_base_class"


def make_distributed(
    optimizer: keras.optimizers.Optimizer, *, compression: str = "none", backward_passes_per_step: int = 1
):
    """Makes ``optimizer`` average its gradients over all Horovod ranks before applying them.

    The instance keeps its state and configuration; only its class is swapped for a subclass
    with the same name and module that allreduces the gradients of every update. Use
    :func:`plain_class` while saving, so that the saved file names the original class and
    loads anywhere (Keras cannot find a class made at run time).

    The allreduce sits where Keras takes the gradients of an update, before clipping: once per
    step, or with gradient accumulation (Keras' ``gradient_accumulation_steps``, which
    ``backward_passes_per_step`` sets) once per ``N`` batches, on their average, so a step that
    only accumulates costs no communication. Wrapping optimizers (``LossScaleOptimizer``) are
    averaged before their own checks instead, on every step (every rank must take the same branch).

    Args:
        optimizer: a Keras 3 optimizer (built or not).
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16).
        backward_passes_per_step: batches whose gradients are accumulated locally and averaged
            once (Horovod's name; equivalent to a batch ``N`` times larger). 1: every batch.

    Returns:
        The same optimizer object.

    Raises:
        InternalsChangedError: this Keras updates its variables in a way the averaging cannot hook
            into (see ``internals.distributed_optimizer_class``).
    """
    import horovod.tensorflow as hvd

    if getattr(optimizer, _DIST_ATTR, None) is not None:
        return optimizer
    if compression not in ("none", "fp16"):
        raise ValueError(f"compression must be 'none' or 'fp16'. Received: {compression!r}.")
    set_accumulation(optimizer, backward_passes_per_step)
    base = type(optimizer)
    comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none

    def average(grads):
        grads = list(grads)
        if hvd.size() == 1:
            return grads
        idx = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]  # IndexedSlices -> dense
        if dense:
            reduced = hvd.grouped_allreduce(dense, op=hvd.Average, compression=comp)
            for i, g in zip(idx, reduced):
                grads[i] = g
        return grads

    optimizer.__class__ = internals.distributed_optimizer_class(optimizer, average)
    setattr(optimizer, _DIST_ATTR, base)
    return optimizer


def set_accumulation(optimizer, steps: int) -> None:
    """Accumulates gradients over ``steps`` batches (Keras' ``gradient_accumulation_steps``).

    An optimizer that already accumulates keeps its own setting when ``steps`` is 1; a built one
    (resumed from a checkpoint) has its accumulators already and cannot change their number."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1. Received: {steps!r}.")
    current = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    if steps == 1 or steps == current:
        return
    if hasattr(optimizer, "inner_optimizer"):
        raise ValueError(
            f"backward_passes_per_step={steps} needs a plain Keras optimizer; {type(optimizer).__name__} wraps "
            "another one: set gradient_accumulation_steps on the inner optimizer instead."
        )
    if optimizer.built:
        raise ValueError(
            f"backward_passes_per_step={steps}, but the optimizer was built with gradient_accumulation_steps="
            f"{current} (a run resumed from a checkpoint keeps the setting it started with)."
        )
    optimizer.gradient_accumulation_steps = steps


@contextlib.contextmanager
def plain_class(optimizer):
    """Within the block, ``optimizer`` is an instance of its original class (for saving)."""
    base = getattr(optimizer, _DIST_ATTR, None) if optimizer is not None else None
    if base is None:
        yield optimizer
        return
    dist = type(optimizer)
    optimizer.__class__ = base
    try:
        yield optimizer
    finally:
        optimizer.__class__ = dist
