"""Keeping every rank's model state equal: rank 0's weights and optimizer state copied to all ranks
when training starts, and the non-trainable state that each rank updates from its own batches
(BatchNormalization's moving statistics, a layer's ``add_weight(trainable=False)``) brought into
agreement before validation and at every epoch end.

``hvd.broadcast_variables`` fails on Keras 3 variables (no ``Variable.ref``); these collectives go
through each Keras variable's backing TF value.
"""

import keras
import tensorflow as tf

_CHUNK_BYTES = 64 * 1024 * 1024  # the variables of one grouped allreduce at most (then the next)


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Sets every variable to its value on ``root_rank`` (Keras 3 variables included), bit for bit.

    The values travel as their bytes (``uint8``) in grouped allreduces of up to 64 MiB each, whatever their
    dtypes (Horovod fuses each group into one collective, where a broadcast per variable costs a round trip
    each): ``root_rank`` gives its bytes, the others zeros, and a byte plus zeros is that byte, on every
    backend (a float sum could change a NaN's payload). ``bool`` travels as ``uint8``; a string variable is
    broadcast alone. Every rank must call it with the same variables, in the same order."""
    import horovod.tensorflow as hvd

    variables = list(variables)
    values = [tf.convert_to_tensor(v.value if hasattr(v, "value") else v) for v in variables]
    mine = hvd.rank() == root_rank
    group: list[int] = []
    size = chunk = 0
    for i, t in enumerate(values):
        if t.dtype == tf.string:
            v = variables[i]
            name = f"bcast.{v.path if hasattr(v, 'path') else v.name}".replace(":", "_")
            v.assign(hvd.broadcast(t, root_rank=root_rank, name=name))
        elif t.shape.num_elements():
            group.append(i)
            size += t.shape.num_elements() * t.dtype.size
            if size >= _CHUNK_BYTES:
                _sum_bytes(variables, values, group, mine, f"hvd_spark.broadcast.{chunk}")
                group, size, chunk = [], 0, chunk + 1
    if group:
        _sum_bytes(variables, values, group, mine, f"hvd_spark.broadcast.{chunk}")


def _sum_bytes(variables, values, group: list[int], mine: bool, name: str) -> None:
    """One grouped allreduce of the bytes of ``values[i]`` for ``i`` in ``group`` (zeros unless ``mine``)."""
    import horovod.tensorflow as hvd

    def as_bytes(t):
        return tf.cast(t, tf.uint8) if t.dtype == tf.bool else tf.bitcast(t, tf.uint8)

    parts = [as_bytes(values[i]) if mine else tf.zeros_like(as_bytes(values[i])) for i in group]
    for i, summed in zip(group, hvd.grouped_allreduce(parts, op=hvd.Sum, name=name)):
        dtype = values[i].dtype
        variables[i].assign(tf.cast(summed, tf.bool) if dtype == tf.bool else tf.bitcast(summed, dtype))


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
