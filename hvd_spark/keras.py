"""Keras 3 pieces for your own Horovod functions run with :func:`hvd_spark.run`.

``horovod.tensorflow.keras`` does not work with Keras 3. These are the same pieces the
estimator uses on its ranks:

    import hvd_spark.keras as hk

    def train():
        import horovod.tensorflow as hvd
        import keras
        hvd.init()
        opt = hk.make_distributed(keras.optimizers.Adam(1e-3 * hvd.size()))
        model.compile(optimizer=opt, loss="mse")
        model.fit(x_shard, y_shard, callbacks=[hk.BroadcastStateCallback(), hk.StateAgreementCallback(),
                                               hk.MetricAverageCallback()])
        if hvd.rank() == 0:
            hk.save_model(model, "/shared/model.keras")

    hvd_spark.run(train, num_proc=2)

- :func:`make_distributed`: the optimizer averages gradients over the ranks (one grouped allreduce per step).
- :class:`BroadcastStateCallback`: rank 0's weights and optimizer state to every rank when training starts.
- :class:`StateAgreementCallback`: layer state that ranks update from their own batches
  (BatchNormalization's moving statistics, ``add_weight(trainable=False)``) averaged before each
  validation run and at each epoch end.
- :class:`MetricAverageCallback`: each epoch's logs averaged over the ranks (put it before
  callbacks that read them).
- :func:`synchronize_batch_norm`: ``BatchNormalization(synchronized=True)`` layers use statistics
  over the global batch on every step.
- :func:`broadcast_variables`, :func:`reconcile_variables`: the collectives under the callbacks.
- :func:`save_model`: saves a model whose optimizer was made distributed so that it loads in plain Keras.

Importing this module imports Keras and TensorFlow; Horovod is imported when a function runs.
"""

from hvd_spark._internal.common.serde import save_model_file as save_model
from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm
from hvd_spark._internal.rank.callbacks import MetricAverageCallback
from hvd_spark._internal.rank.optimizer import make_distributed
from hvd_spark._internal.rank.state import (
    BroadcastStateCallback,
    StateAgreementCallback,
    broadcast_variables,
    reconcile_variables,
)

__all__ = [
    "make_distributed",
    "BroadcastStateCallback",
    "StateAgreementCallback",
    "MetricAverageCallback",
    "synchronize_batch_norm",
    "broadcast_variables",
    "reconcile_variables",
    "save_model",
]
