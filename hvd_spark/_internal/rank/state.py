"""Keeping every rank's model state equal: rank 0's weights and optimizer state copied to all ranks
when training starts, and the non-trainable state that each rank updates from its own batches
(BatchNormalization's moving statistics, a layer's ``add_weight(trainable=False)``) brought into
agreement before validation and at every epoch end.

``hvd.broadcast_variables`` fails on Keras 3 variables (no ``Variable.ref``); these collectives go
through each Keras variable's backing TF value.
"""

import keras
import tensorflow as tf


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Sets every variable to its value on ``root_rank`` (Keras 3 variables included)."""
    import horovod.tensorflow as hvd

    for v in variables:
        value = v.value if hasattr(v, "value") else v
        v.assign(
            hvd.broadcast(
                tf.convert_to_tensor(value),
                root_rank=root_rank,
                name=f"bcast.{v.path if hasattr(v, 'path') else v.name}".replace(":", "_"),
            )
        )


def reconcile_variables(variables, *, name: str = "state") -> int:
    """Brings variables whose values differ between ranks into agreement; returns how many differed.

    Each rank hashes every variable; the hashes are allgathered, so every rank sees the same
    list of variables that differ. Floating-point ones are averaged over the ranks (one grouped
    allreduce), others (integer counters) take rank 0's value. Variables that already agree,
    e.g. frozen layers, are left bit-for-bit as they are.
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
    if floats:
        averaged = hvd.grouped_allreduce([tf.convert_to_tensor(v.value) for v in floats], op=hvd.Average)
        for v, value in zip(floats, averaged):
            v.assign(value)
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
        broadcast_variables(model.variables)
        if opt is not None:
            broadcast_variables(opt.variables)


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
