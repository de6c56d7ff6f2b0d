"""``TorchEstimator``: fit a torch ``nn.Module`` on a Spark DataFrame, on the estimator machinery of
``HorovodEstimator`` (Params, checks, data, launcher, restarts, store) with torch's framework
(``ml/torch_framework.py``) in place of Keras'."""

from typing import Any

from pyspark import keyword_only

from hvd_spark._internal.ml.estimator import HorovodEstimator
from hvd_spark._internal.ml.fit_params import FitParams
from hvd_spark._internal.ml.params import _param

_KERAS_ONLY = ("custom_objects", "class_weight", "checkpoint_callback")


def _model(x):
    if x is None or (callable(getattr(x, "parameters", None)) and callable(getattr(x, "state_dict", None))):
        return x
    raise TypeError(f"model must be a torch.nn.Module. Received: {type(x).__name__}.")


def _optimizer(x):
    if x is None or callable(x) or hasattr(x, "param_groups"):
        return x
    raise TypeError(
        f"optimizer must be a torch optimizer built on the model's parameters, or a function params -> optimizer. "
        f"Received: {x!r}."
    )


def _loss(x):
    if x is None or callable(x) or (isinstance(x, (list, tuple)) and all(callable(v) for v in x)):
        return x
    raise TypeError(
        f"loss must be a loss (a torch.nn loss module or a function (outputs, labels) -> loss), or a list of them "
        f"(one per output). Received: {x!r}."
    )


def _metrics(x):
    if x is None or (isinstance(x, (list, tuple)) and all(callable(v) or hasattr(v, "compute") for v in x)):
        return x
    raise TypeError(
        f"metrics must be a list of torchmetrics metrics or functions (outputs, labels) -> number. Received: {x!r}."
    )


def _callbacks(x):
    from hvd_spark._internal.rank.torch_callbacks import HOOKS, is_callback

    if x is None or (isinstance(x, (list, tuple)) and all(is_callback(c) for c in x)):
        return x
    raise TypeError(
        f"callbacks must be a list of hvd_spark.torch.Callback objects (or objects with any of {', '.join(HOOKS)}); "
        f"Keras callbacks do not apply to a torch model. Received: {x!r}."
    )


def _keras_only(name: str):
    def conv(x):
        if x is None:
            return x
        raise ValueError(f"{name} is a Keras parameter; TorchEstimator does not take it. Received: {name}={x!r}.")

    return conv


def _input_shapes(x):
    if x is None:
        return x
    if isinstance(x, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and s and all(isinstance(d, int) and not isinstance(d, bool) for d in s) for s in x
    ):
        return [list(s) for s in x]
    raise TypeError(f"input_shapes must be a list of shapes, each with its batch axis first (-1). Received: {x!r}.")


def _optional_callable(name: str):
    def conv(x):
        if x is None or callable(x):
            return x
        raise TypeError(f"{name} must be a function. Received: {x!r}.")

    return conv


def _optional_bool(x):
    if x is None or isinstance(x, bool):
        return x
    raise TypeError(f"find_unused_parameters must be True or False. Received: {x!r}.")


def _loss_constructors(x):
    if x is None or (isinstance(x, (list, tuple)) and all(callable(v) for v in x)):
        return x
    raise TypeError(f"loss_constructors must be a list of functions () -> loss. Received: {x!r}.")


class TorchFitParams(FitParams):
    """``FitParams`` with ``TorchEstimator``'s converters of the model, optimizer, loss, metrics and
    callbacks, and the Keras-only Params refused."""

    own_converters = {
        "model": _model,
        "optimizer": _optimizer,
        "loss": _loss,
        "metrics": _metrics,
        "callbacks": _callbacks,
        **{name: _keras_only(name) for name in _KERAS_ONLY},
    }


class TorchEstimator(HorovodEstimator):
    """Trains a torch ``nn.Module`` on a DataFrame with data-parallel synchronous SGD: every rank runs a
    plain torch loop over its share of each epoch's rows, gradients averaged by
    ``torch.nn.parallel.DistributedDataParallel`` over Gloo. Returns a :class:`hvd_spark.torch.TorchModel`.

    Parameter names follow ``horovod.spark.torch.TorchEstimator`` (its code ports by changing imports):
    ``model`` (an ``nn.Module``), ``optimizer`` (built on ``model.parameters()``, or a function params ->
    optimizer), ``loss`` (a loss module or function, or one per output; ``loss_constructors``: functions
    making them), ``loss_weights``, ``metrics`` (torchmetrics metrics, or functions (outputs, labels) ->
    number), ``input_shapes`` (each with the batch axis ``-1``), ``train_minibatch_fn`` (horovod.spark's
    ``fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs,
    loss)``); the data, launch, checkpoint, resume and elastic params are ``HorovodEstimator``'s.

    The model's forward takes one tensor per feature column (float32, int64 for integer columns) and
    returns one tensor per label column (a tuple for several). A class-index loss (``CrossEntropyLoss``,
    ``NLLLoss``) gets its labels as int64 class indices; any other gets them in its output's shape.
    ``docs/torch.md`` has the rules (sample weights, BatchNorm, dropout) and what is not supported.
    """

    model = _param("model", "The torch.nn.Module to train.", _model)
    optimizer = _param(
        "optimizer", "A torch optimizer built on model.parameters(), or a function params -> optimizer.", _optimizer
    )
    loss = _param("loss", "A loss module or function (outputs, labels) -> loss, or a list (one per output).", _loss)
    metrics = _param("metrics", "torchmetrics metrics, or functions (outputs, labels) -> number.", _metrics)
    callbacks = _param(
        "callbacks", "hvd_spark.torch.Callback objects, called on every rank (docs/torch.md).", _callbacks
    )
    custom_objects = _param("custom_objects", "Keras only (None).", _keras_only("custom_objects"))
    class_weight = _param("class_weight", "Keras only (None).", _keras_only("class_weight"))
    checkpoint_callback = _param("checkpoint_callback", "Keras only (None).", _keras_only("checkpoint_callback"))
    input_shapes = _param(
        "input_shapes",
        "horovod.spark's: the shape of each input, batch axis first (-1). Default: the columns'.",
        _input_shapes,
    )
    train_minibatch_fn = _param(
        "train_minibatch_fn",
        "horovod.spark's: fn(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights) -> "
        "(outputs, loss), replacing the training step (it calls backward and optimizer.step itself).",
        _optional_callable("train_minibatch_fn"),
    )
    find_unused_parameters = _param(
        "find_unused_parameters",
        "DistributedDataParallel's: True for a model whose forward leaves some parameters unused (default False).",
        _optional_bool,
    )
    loss_constructors = _param(
        "loss_constructors",
        "horovod.spark's: functions () -> loss, one per output (in place of loss).",
        _loss_constructors,
    )

    _params_record = TorchFitParams
    _framework_params: tuple[str, ...] = (
        "input_shapes",
        "train_minibatch_fn",
        "loss_constructors",
        "find_unused_parameters",
    )
    # Saved in one pickle: an optimizer built on the model keeps its parameters (persistence.py).
    _pickled_together: tuple[str, ...] = (
        "model",
        "optimizer",
        "loss",
        "metrics",
        "train_minibatch_fn",
        "loss_constructors",
    )

    @keyword_only
    def __init__(self, **kwargs: Any):
        given = self._input_kwargs  # type: ignore[attr-defined]  # set by @keyword_only
        super(HorovodEstimator, self).__init__()
        self._init_defaults()
        self.setParams(**given)

    def _init_defaults(self) -> None:
        from hvd_spark._internal.ml.fit_params import DEFAULTS

        self._backend_object = None
        self._setDefault(**DEFAULTS)
        self._setDefault(
            input_shapes=None, train_minibatch_fn=None, loss_constructors=None, find_unused_parameters=False
        )

    @keyword_only
    def setParams(self, **kwargs: Any) -> "TorchEstimator":
        """Sets any of the constructor's parameters."""
        unknown = [k for k in kwargs if not self.hasParam(k)]
        if unknown:
            raise TypeError(f"Unknown TorchEstimator parameters: {unknown}.")
        self._set(**kwargs)
        return self

    def _framework(self):
        from hvd_spark._internal.ml.torch_framework import TorchFramework

        return TorchFramework(
            input_shapes=self.getOrDefault(self.input_shapes),
            train_minibatch_fn=self.getOrDefault(self.train_minibatch_fn),
            find_unused_parameters=bool(self.getOrDefault(self.find_unused_parameters)),
        )

    def _fit_params(self):
        import dataclasses

        p = super()._fit_params()
        constructors = self.getOrDefault(self.loss_constructors)
        if constructors:
            if p.loss is not None:
                raise ValueError("Give loss or loss_constructors, not both.")
            p = dataclasses.replace(p, loss=[make() for make in constructors])
        return p


TorchEstimator.__module__ = "hvd_spark.torch"
