"""hvd_spark for torch models: ``TorchEstimator`` -> ``TorchModel`` (horovod.spark.torch's names).

    from hvd_spark.torch import TorchEstimator
    model = TorchEstimator(num_proc=2, store="/tmp/store", model=net, optimizer=opt, loss=nn.CrossEntropyLoss(),
                           feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=5).fit(df)
    model.transform(df)

``global_batch_loss(loss_fn, outputs, labels)`` normalises a loss of your own code over the global batch
(a masked sequence loss in a ``LightningModule``, a function under ``hvd_spark.run``).

Needs the ``torch`` extra (``pip install 'hvd_spark[torch]'``); docs/torch.md says what works.
"""

from hvd_spark._internal.ml.torch_estimator import TorchEstimator
from hvd_spark._internal.ml.torch_model import TorchModel
from hvd_spark._internal.rank.torch_callbacks import Callback, TrainState
from hvd_spark._internal.rank.torch_losses import global_batch_loss

__all__ = ["Callback", "TorchEstimator", "TorchModel", "TrainState", "global_batch_loss"]
