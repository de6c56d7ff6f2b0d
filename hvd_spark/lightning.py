"""hvd_spark for Lightning modules: ``TorchEstimator`` (horovod.spark.lightning's name) trains a
``lightning.pytorch.LightningModule`` with Lightning's ``Trainer`` on hvd_spark's ranks and returns a
``TorchModel``. ``global_batch_loss(loss_fn, outputs, labels)`` in ``training_step`` makes a masked
sequence loss that of the global batch. Needs the ``lightning`` extra; docs/torch.md says what works.
"""

from hvd_spark._internal.ml.lightning_estimator import TorchEstimator
from hvd_spark._internal.ml.torch_model import TorchModel
from hvd_spark._internal.rank.torch_losses import global_batch_loss

__all__ = ["TorchEstimator", "TorchModel", "global_batch_loss"]
