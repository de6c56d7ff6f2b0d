"""``hvd_spark.lightning.TorchEstimator``: a ``LightningModule`` trained by Lightning's ``Trainer`` on
hvd_spark's ranks and data (horovod.spark.lightning's names), returning a ``TorchModel``."""

from hvd_spark._internal.ml.params import _param
from hvd_spark._internal.ml.torch_estimator import TorchEstimator as _TorchEstimator
from hvd_spark._internal.ml.torch_estimator import TorchFitParams

# horovod.spark.lightning's params hvd_spark takes only unset (their work is done otherwise, or not at all).
_UNSET_ONLY = (
    "loader_num_epochs",
    "profiler",
    "debug_data_loader",
    "train_async_data_loader_queue_size",
    "val_async_data_loader_queue_size",
    "num_gpus",
)


def _lightning_callbacks(x):
    if x is None or (isinstance(x, (list, tuple)) and all(hasattr(cb, "on_train_epoch_end") for cb in x)):
        return x
    raise TypeError(f"callbacks must be a list of lightning.pytorch.Callback objects. Received: {x!r}.")


def _unset(name: str):
    def conv(x):
        if x is None:
            return x
        raise ValueError(
            f"{name} is horovod.spark.lightning's; hvd_spark's Lightning estimator takes it only unset "
            f"(docs/torch.md, 'Lightning'). Received: {name}={x!r}."
        )

    return conv


def _steps(x):
    if x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1):
        return x
    raise ValueError(f"log_every_n_steps must be an integer >= 1. Received: {x!r}.")


class LightningFitParams(TorchFitParams):
    """``TorchFitParams`` with Lightning callbacks."""

    own_converters = {**TorchFitParams.own_converters, "callbacks": _lightning_callbacks}


class TorchEstimator(_TorchEstimator):
    """Trains a ``lightning.pytorch.LightningModule`` with Lightning's ``Trainer`` on every rank (DDP over
    Gloo), on the rank's share of each epoch's rows, and returns a :class:`hvd_spark.torch.TorchModel`.

    The module configures its optimizers (``configure_optimizers``), computes its loss in
    ``training_step`` and logs what it wants with ``self.log`` (the epoch's logged values are the fit's
    history). Its batches are dicts ``{column name: tensor}`` of ``feature_cols``, ``label_cols`` (and
    ``sample_weight_col``), as horovod.spark.lightning gives them; ``transform`` calls its ``forward``
    with one tensor per feature column. ``callbacks`` are Lightning callbacks, ``logger`` the Trainer's
    logger (default: none). Checkpoints, resume, restarts and the data are hvd_spark's (docs/torch.md).
    """

    callbacks = _param("callbacks", "Lightning callbacks (lightning.pytorch.Callback) for every rank's Trainer.")
    logger = _param("logger", "The Trainer's logger (a lightning.pytorch logger). Default: none.")
    log_every_n_steps = _param("log_every_n_steps", "The Trainer's log_every_n_steps (default 50).", _steps)
    terminate_on_nan = _param(
        "terminate_on_nan",
        "horovod.spark.lightning's: unset or False (Lightning stops on a NaN loss itself only with a callback).",
        _unset("terminate_on_nan"),
    )
    loader_num_epochs = _param(
        "loader_num_epochs", "horovod.spark.lightning's; unset only.", _unset("loader_num_epochs")
    )
    profiler = _param("profiler", "horovod.spark.lightning's; unset only.", _unset("profiler"))
    debug_data_loader = _param(
        "debug_data_loader", "horovod.spark.lightning's; unset only.", _unset("debug_data_loader")
    )
    train_async_data_loader_queue_size = _param(
        "train_async_data_loader_queue_size",
        "horovod.spark.lightning's; unset only.",
        _unset("train_async_data_loader_queue_size"),
    )
    val_async_data_loader_queue_size = _param(
        "val_async_data_loader_queue_size",
        "horovod.spark.lightning's; unset only.",
        _unset("val_async_data_loader_queue_size"),
    )
    num_gpus = _param(
        "num_gpus", "horovod.spark.lightning's; unset only (use_gpu and Spark's GPU resources).", _unset("num_gpus")
    )

    _params_record = LightningFitParams
    _pickled_together = (*_TorchEstimator._pickled_together, "logger")
    _framework_params = (
        *_TorchEstimator._framework_params,
        "logger",
        "log_every_n_steps",
        "terminate_on_nan",
        *_UNSET_ONLY,
    )

    def _init_defaults(self) -> None:
        super()._init_defaults()
        self._setDefault(logger=None, log_every_n_steps=None, terminate_on_nan=None, **dict.fromkeys(_UNSET_ONLY))

    def _framework(self):
        from hvd_spark._internal.ml.lightning_framework import LightningFramework

        for name in ("train_minibatch_fn", "loss_constructors", "find_unused_parameters"):
            if self.getOrDefault(name) not in (None, False):
                raise ValueError(
                    f"{name} is not taken with a LightningModule: its training_step is the step, and Lightning's "
                    f"DDP strategy its own. Received: {name}={self.getOrDefault(name)!r}."
                )

        return LightningFramework(
            input_shapes=self.getOrDefault(self.input_shapes),
            logger=self.getOrDefault(self.logger),
            log_every_n_steps=self.getOrDefault(self.log_every_n_steps),
        )


TorchEstimator.__module__ = "hvd_spark.lightning"
