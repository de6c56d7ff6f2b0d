"""hvd_spark for Lightning modules: ``TorchEstimator`` (horovod.spark.lightning's name) trains a
``lightning.pytorch.LightningModule`` with Lightning's ``Trainer`` on hvd_spark's ranks and returns a
``TorchModel``. Needs the ``lightning`` extra; docs/torch.md says what works.
"""

from hvd_spark._internal.ml.lightning_estimator import TorchEstimator
from hvd_spark._internal.ml.torch_model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
