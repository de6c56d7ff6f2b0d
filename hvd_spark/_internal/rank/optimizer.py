"""Gradient averaging for Keras 3 optimizers over Horovod ranks.

``horovod.tensorflow.keras`` does not work with Keras 3 (its optimizer wrapper touches
``Variable.ref``, which Keras 3 variables lack). Here the optimizer instance gets a subclass of its
own class that averages the gradients of each update with one ``hvd.grouped_allreduce``
(:func:`make_distributed`); ``common/serde.py``'s ``plain_class`` gives it back its original class while it
is saved.
"""

import keras
import tensorflow as tf

from hvd_spark._internal.common import internals
from hvd_spark._internal.common.serde import DIST_BASE_ATTR as _DIST_ATTR


def make_distributed(
    optimizer: keras.optimizers.Optimizer,
    *,
    compression: str = "none",
    backward_passes_per_step: int = 1,
    sparse_as_dense: bool = False,
):
    """Makes ``optimizer`` average its gradients over all Horovod ranks before applying them.

    The instance keeps its state and configuration; only its class is swapped for a subclass
    with the same name and module that allreduces the gradients of every update. Use
    ``common/serde.py``'s ``plain_class`` while saving, so that the saved file names the original class and
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
        sparse_as_dense: send an ``IndexedSlices`` gradient (an ``Embedding``'s, any ``take`` /
            ``gather``) as a dense tensor of the whole variable (Horovod's ``sparse_as_dense``), so
            the optimizer takes its dense update. False (the default): it stays ``IndexedSlices``,
            as one process at the global batch has it (see :func:`average_gradients`).

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
        return average_gradients(grads, compression=comp, sparse_as_dense=sparse_as_dense)

    optimizer.__class__ = internals.distributed_optimizer_class(optimizer, average)
    setattr(optimizer, _DIST_ATTR, base)
    return optimizer


def average_gradients(grads, *, compression=None, sparse_as_dense: bool = False) -> list:
    """The gradients one process would compute on the global batch, from each rank's own.

    Dense gradients: one ``hvd.grouped_allreduce`` with ``op=Average`` (each rank's loss is a mean over
    its equal share of the global batch). ``IndexedSlices`` (the rows of a table that the batch looked
    up): the ranks' indices and values are gathered (``hvd.grouped_allgather``, in rank order) and the
    values scaled by ``1 / N``, which is the ``IndexedSlices`` TensorFlow gives one process for the
    concatenated batch (one row per lookup, duplicates not merged). The optimizer then takes the same
    update as in plain Keras: Keras' Adam, RMSprop and Adagrad update their moments from an
    ``IndexedSlices`` one lookup at a time, so an id looked up k times in a batch counts k times, where a
    dense gradient holds the sum of the k rows (SGD is the same either way). The bytes sent grow with
    the rows looked up, not with the table.

    Args:
        grads: a list of tensors, ``IndexedSlices`` or None (a variable without a gradient).
        compression: a Horovod compressor (``hvd.Compression.fp16`` sends float16), or None.
        sparse_as_dense: reduce ``IndexedSlices`` as dense tensors instead.
    """
    import horovod.tensorflow as hvd

    grads = list(grads)
    size = hvd.size()
    if size == 1:
        return grads
    comp = compression or hvd.Compression.none
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices) and not sparse_as_dense]
    dense = [
        i
        for i, g in enumerate(grads)
        if g is not None and not (isinstance(g, tf.IndexedSlices) and not sparse_as_dense)
    ]
    if dense:
        reduced = hvd.grouped_allreduce(
            [tf.convert_to_tensor(grads[i]) for i in dense], op=hvd.Average, compression=comp
        )  # IndexedSlices -> dense only with sparse_as_dense
        for i, g in zip(dense, reduced):
            grads[i] = g
    if sparse:
        packed = [comp.compress(grads[i].values) for i in sparse]
        sent = [v for v, _ in packed] + [grads[i].indices for i in sparse]
        gathered = _gather_by_dtype(sent)
        for k, i in enumerate(sparse):
            values = comp.decompress(gathered[k], packed[k][1])
            values = values / tf.cast(size, values.dtype)
            grads[i] = tf.IndexedSlices(values, gathered[len(sparse) + k], dense_shape=grads[i].dense_shape)
    return grads


def _gather_by_dtype(tensors: list) -> list:
    """``hvd.grouped_allgather`` of ``tensors`` (one group per dtype: a group holds one dtype), in order."""
    import horovod.tensorflow as hvd

    out: list = [None] * len(tensors)
    for dtype in sorted({t.dtype for t in tensors}, key=lambda d: d.name):
        picked = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        done = hvd.grouped_allgather([tensors[i] for i in picked], name=f"hvd_spark.sparse_gradients.{dtype.name}")
        for i, t in zip(picked, done):
            out[i] = t
    return out


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
