"""Keeping every rank's model state equal: rank 0's weights and optimizer state copied to all ranks
when training starts, and the non-trainable state that each rank updates from its own batches
(BatchNormalization's moving statistics, a layer's ``add_weight(trainable=False)``) brought into
agreement before validation and at every epoch end.

``hvd.broadcast_variables`` fails on Keras 3 variables (no ``Variable.ref``); these collectives go
through each Keras variable's backing TF value.
"""

import keras
import tensorflow as tf

# dtypes Horovod sums as they are (its allreduce's types)
_SUMMED = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Sets every variable to its value on ``root_rank`` (Keras 3 variables included), bit for bit.

    The values travel in one grouped allreduce per dtype (Horovod fuses each into one collective,
    where a broadcast per variable costs a round trip each): ``root_rank`` gives its values, the others
    zeros, negative ones for floats, which leave every value as it was (``x + -0.0`` is ``x`` for every
    float, ``-0.0`` and NaN included). A dtype Horovod cannot sum travels as its bytes (``bfloat16``, which
    Horovod neither sums nor broadcasts, ``int16``, ...), ``bool`` as ``uint8``; a string variable is
    broadcast alone."""
    import horovod.tensorflow as hvd

    variables = list(variables)
    values = [tf.convert_to_tensor(v.value if hasattr(v, "value") else v) for v in variables]
    wires = [_on_the_wire(t) for t in values]
    mine = hvd.rank() == root_rank
    for dtype in sorted({w.dtype.name for w, _ in wires if w is not None}):  # an op takes one dtype
        group = [i for i, (w, _) in enumerate(wires) if w is not None and w.dtype.name == dtype]
        parts = [wires[i][0] if mine else _negative_zeros(wires[i][0]) for i in group]
        for i, value in zip(group, hvd.grouped_allreduce(parts, op=hvd.Sum, name=f"hvd_spark.broadcast.{dtype}")):
            variables[i].assign(wires[i][1](value))
    for i in (i for i, (w, _) in enumerate(wires) if w is None):
        v = variables[i]
        name = f"bcast.{v.path if hasattr(v, 'path') else v.name}".replace(":", "_")
        v.assign(hvd.broadcast(values[i], root_rank=root_rank, name=name))


def _on_the_wire(t):
    """``t`` as a tensor Horovod sums, and the function giving ``t``'s dtype back; (None, None): neither."""
    if t.dtype.name in _SUMMED:
        return t, lambda w: w
    if t.dtype == tf.bool:
        return tf.cast(t, tf.uint8), lambda w: tf.cast(w, tf.bool)
    if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex:
        return tf.bitcast(t, tf.uint8), lambda w, dtype=t.dtype: tf.bitcast(w, dtype)
    return None, None


def _negative_zeros(t):
    """Zeros shaped as ``t``: negative ones for floats."""
    return tf.fill(tf.shape(t), tf.constant(-0.0 if t.dtype.is_floating else 0, t.dtype))


def reconcile_variables(variables, *, name: str = "state") -> int:
    """Brings variables whose values differ between ranks into agreement; returns how many differed.

    Each rank hashes every variable; the hashes are allgathered, so every rank sees the same
    list of variables that differ. Floating-point ones are averaged over the ranks (one grouped
    allreduce per dtype; bfloat16 averaged in float32), others (integer counters) take rank 0's
    value. Variables that already agree, e.g. frozen layers, are left bit-for-bit as they are.
    """
    import hashlib

    import horovod.tensorflow as hvd
    import numpy as np

    variables = list(variables)
    if hvd.size() == 1 or not variables:
        return 0
    digests = np.array(
        [
            [
                int.from_bytes(
                    hashlib.blake2b(np.ascontiguousarray(np.asarray(v)).tobytes(), digest_size=7).digest(), "little"
                )
                for v in variables
            ]
        ],
        dtype=np.int64,
    )
    gathered = hvd.allgather(tf.constant(digests), name=f"hvd_spark.{name}.digests").numpy()
    differ = [variables[i] for i in range(len(variables)) if (gathered[:, i] != gathered[0, i]).any()]
    floats = [v for v in differ if keras.backend.standardize_dtype(v.dtype).startswith(("float", "bfloat"))]
    for dtype in sorted({keras.backend.standardize_dtype(v.dtype) for v in floats}):  # an op takes one dtype
        group = [v for v in floats if keras.backend.standardize_dtype(v.dtype) == dtype]
        wire = "float32" if dtype == "bfloat16" else dtype  # Horovod does not reduce bfloat16
        values = [tf.cast(tf.convert_to_tensor(v.value), wire) for v in group]
        for v, value in zip(group, hvd.grouped_allreduce(values, op=hvd.Average, name=f"hvd_spark.{name}.{dtype}")):
            v.assign(tf.cast(value, v.dtype))
    others = [v for v in differ if not any(v is f for f in floats)]
    if others:
        broadcast_variables(others)
    return len(differ)


class BroadcastStateCallback(keras.callbacks.Callback):
    """At the start of training, copies rank 0's weights and optimizer state to every rank."""

    def on_train_begin(self, logs=None):
        model = self.model
        opt = model.optimizer
        if opt is not None and not opt.built:
            opt.build(model.trainable_variables)
        broadcast_variables(list(model.variables) + (list(opt.variables) if opt is not None else []))


class StateAgreementCallback(keras.callbacks.Callback):
    """Averages the non-trainable state that each rank updates from its own batches.

    Gradients are averaged, so trainable weights agree after every step; state that layers
    update in their forward pass (BatchNormalization's moving mean and variance, a custom
    layer's ``add_weight(trainable=False)``) does not. This brings it into agreement before
    every validation run inside ``fit`` and at every epoch end (so before checkpoints,
    user callbacks and the final save). Between those points ranks keep their own running
    statistics; with ``BatchNormalization(synchronized=True)`` they agree on every step instead
    (see ``rank.batchnorm.synchronize_batch_norm``). Put it before callbacks that save the model.
    """

    def __init__(self):
        super().__init__()
        self._in_fit = False
        self.reconciled = 0

    def _reconcile(self):
        self.reconciled += reconcile_variables(self.model.non_trainable_weights, name="non_trainable")

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_test_begin(self, logs=None):
        if self._in_fit:  # the validation run of fit(): every rank runs it at the same point
            self._reconcile()

    def on_epoch_end(self, epoch, logs=None):
        self._reconcile()

    def on_train_end(self, logs=None):
        self._in_fit = False
