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

- :func:`make_distributed`: the optimizer averages gradients over the ranks (one grouped allreduce per step;
  an Embedding's ``IndexedSlices`` gathered as ``IndexedSlices``, as one process at the global batch has them).
- :func:`global_batch_losses`: masked, weighted-mean and ``"sum"`` losses reduced over the global batch
  during training (call it after ``compile``).
- :class:`BroadcastStateCallback`: rank 0's weights and optimizer state to every rank when training starts.
- :class:`StateAgreementCallback`: layer state that ranks update from their own batches
  (BatchNormalization's moving statistics, ``add_weight(trainable=False)``) averaged before each
  validation run and at each epoch end.
- :class:`MetricAverageCallback`: each epoch's metrics over all ranks' rows (their states summed;
  other logs averaged); put it before callbacks that read them.
- :func:`synchronize_batch_norm`: ``BatchNormalization(synchronized=True)`` layers use statistics
  over the global batch on every step.
- :func:`broadcast_variables`, :func:`reconcile_variables`: the collectives under the callbacks.
- :func:`save_model`: saves a model whose optimizer was made distributed so that it loads in plain Keras.
- :class:`BestModelCheckpoint`: horovod.tensorflow.keras's, for the estimator's ``checkpoint_callback``:
  the model ``fit`` returns is the best epoch's by ``monitor``, not the last one's.

Importing this module imports Keras and TensorFlow; Horovod is imported when a function runs.
"""

import keras

from hvd_spark._internal.common.serde import save_model_file as save_model
from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm
from hvd_spark._internal.rank.callbacks import MetricAverageCallback
from hvd_spark._internal.rank.losses import global_batch_losses
from hvd_spark._internal.rank.optimizer import make_distributed
from hvd_spark._internal.rank.state import (
    BroadcastStateCallback,
    StateAgreementCallback,
    broadcast_variables,
    reconcile_variables,
)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``horovod.tensorflow.keras.callbacks.BestModelCheckpoint``, for Keras 3: a ``ModelCheckpoint``
    with ``save_best_only=True`` whose file is set by the estimator. Given as
    ``HorovodEstimator(checkpoint_callback=BestModelCheckpoint(...))``, rank 0 keeps the best epoch's
    model by ``monitor`` and ``mode`` in its temporary folder, and that model is the one ``fit``
    returns (its weights, with ``save_weights_only``, loaded into the last epoch's model); hvd_spark's
    own epoch checkpoints (for resume) are written as well.

    Args:
        monitor: the metric that decides (default ``"val_loss"``; a ``val_`` metric needs ``validation``).
        verbose: 1 logs each save on rank 0.
        save_weights_only: keep only the weights of the best epoch (default False: the whole model).
        mode: ``"auto"``, ``"min"`` or ``"max"``: whether lower or higher ``monitor`` is better.
        save_freq: ``"epoch"`` (default), or a number of batches, as Keras' ``ModelCheckpoint``.

    Its ``filepath`` (``best.keras``, or ``best.weights.h5`` with ``save_weights_only``) is replaced
    by the estimator; used outside a fit, it writes there, in the working directory.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
    ):
        super().__init__(
            filepath="best.weights.h5" if save_weights_only else "best.keras",
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )


__all__ = [
    "BestModelCheckpoint",
    "make_distributed",
    "global_batch_losses",
    "BroadcastStateCallback",
    "StateAgreementCallback",
    "MetricAverageCallback",
    "synchronize_batch_norm",
    "broadcast_variables",
    "reconcile_variables",
    "save_model",
]
