"""The estimator's parameters as one typed record (:class:`FitParams`), and the table of their
defaults (:data:`DEFAULTS`), grouped as the docs list them (docs/estimator.md).

``DEFAULTS`` is the one place a default is defined: the estimator's ``_setDefault`` takes it, and
``FitParams.from_params`` fills a missing name from it. The constructor's signature spells each default
out again (pyspark's ``@keyword_only`` convention, for IDEs and ``help()``); a fast test reads it and
``_setDefault`` from estimator.py's source and holds both, and ``FitParams``, to this table.

``fit`` builds the record once from the Params; the converters that checked each Param when it was set
(converters.py) validate it again, so a value can reach ``fit`` by no path that skips them.

Pure: no Spark, Keras or Horovod, so the fast tier tests it.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from hvd_spark._internal.common.choices import MLFLOW_MODES
from hvd_spark._internal.ml.converters import (
    CONVERTERS,
    boolean,
    choice,
    every_seconds,
    int_at_least,
    is_backend_object,
    normalized_mlflow,
)

# Also the converters' names that the estimator and the transformer import from here.
__all__ = [
    "COMPATIBILITY",
    "CONVERTERS",
    "DEFAULTS",
    "HOW_IT_RUNS",
    "LEARNS",
    "FitParams",
    "boolean",
    "choice",
    "every_seconds",
    "int_at_least",
    "is_backend_object",
]

# The default of every Param, in the docs' three groups. None: unset (the Param's doc says what that means).
# What the model learns: the model, its data and its training (what a tuning grid searches).
LEARNS: dict[str, Any] = {
    "model": None,  # required
    "optimizer": None,
    "loss": None,
    "loss_weights": None,
    "metrics": None,
    "learning_rate": None,
    "custom_objects": None,
    "feature_cols": None,  # required
    "label_cols": None,  # required
    "output_cols": None,
    "sample_weight_col": None,
    "validation": None,
    "callbacks": None,
    "class_weight": None,
    "validation_freq": 1,
    "batch_size": 32,
    "val_batch_size": None,
    "epochs": 1,
    "train_steps_per_epoch": None,
    "validation_steps_per_epoch": None,
    "shuffle": True,
    "shuffle_buffer_size": 10000,
    "random_seed": 0,
    "backward_passes_per_step": 1,
    "gradient_compression": "none",
    "task": "auto",
    "transformation_fn": None,
    "label_shapes": None,
    "checkpoint_callback": None,
}
# How it runs: where and on what, reading the data, timeouts, failures, tracking (none changes the model).
HOW_IT_RUNS: dict[str, Any] = {
    "num_proc": None,
    "store": None,  # required
    "run_id": None,
    "verbose": 1,
    "backend": "gloo",
    "backend_env": None,
    "use_gpu": None,
    "start_timeout": None,
    "stall_timeout": None,
    "max_restarts": 0,
    "min_num_proc": None,
    "max_num_proc": None,
    "elastic_timeout": None,
    "checkpoint_every": None,
    "keep_checkpoints": None,
    "reader": "arrow",
    "materialize": "auto",
    "reuse_data": "auto",
    "mlflow": "auto",
    "mp_start_method": None,
    "tensorflow_dataset_prefetch_buffer_size": 0,
    "partitions_per_process": None,
    "train_reader_num_workers": 2,
    "val_reader_num_workers": 2,
    "reader_pool_type": "thread",
    "inmemory_cache_all": False,
}
# Compatibility: horovod.spark's names taken so that its code runs, with no use in hvd_spark (None only).
COMPATIBILITY: dict[str, Any] = {"data_module": None, "continuous_cols": None, "categorical_cols": None}
DEFAULTS: dict[str, Any] = {**LEARNS, **HOW_IT_RUNS, **COMPATIBILITY}

# None given for these means their default (horovod.spark's spelling of it); every other Param with a
# default other than None refuses None.
_NONE_IS_DEFAULT = ("backend", "mlflow")
_NOT_NONE = tuple(k for k, v in DEFAULTS.items() if v is not None and k not in _NONE_IS_DEFAULT)


@dataclasses.dataclass(frozen=True)
class FitParams:
    """The estimator's Params, as ``fit`` reads them: built once (:meth:`from_params`) when ``fit``
    starts, every value checked by its converter and the required ones present. Field names are the
    Param names, their defaults :data:`DEFAULTS`; the docs of the values are the Params' (params.py).

    ``feature_cols``, ``label_cols`` and ``output_cols`` are the lists the user gave until ``fit``
    matched them to the model (``dataclasses.replace`` with the model's order)."""

    store: Any  # a path, URL or Store (required)
    model: Any  # a Keras model (required)
    feature_cols: Any  # list of names (or of name lists) or dict (required)
    label_cols: Any  # (required)
    num_proc: int | None
    optimizer: Any
    learning_rate: float | None
    loss: Any
    loss_weights: Any
    metrics: Any
    custom_objects: dict[str, Any] | None
    output_cols: Any
    sample_weight_col: str | None
    validation: float | str | None
    callbacks: list | tuple | None
    class_weight: dict[int, float] | None
    validation_freq: int | list[int]
    batch_size: int
    val_batch_size: int | None
    epochs: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    shuffle: bool
    shuffle_buffer_size: int
    random_seed: int
    run_id: str | None
    verbose: int
    backend: str  # the controller's name; a backend object stays on the estimator
    start_timeout: float | None
    stall_timeout: float | None
    use_gpu: bool | None
    max_restarts: int
    min_num_proc: int | None
    max_num_proc: int | None
    elastic_timeout: float | None
    checkpoint_every: int | str | None
    keep_checkpoints: int | None
    backend_env: dict[str, str] | None
    mp_start_method: str | None
    tensorflow_dataset_prefetch_buffer_size: int
    partitions_per_process: int | None
    transformation_fn: Any
    train_reader_num_workers: int
    val_reader_num_workers: int
    reader_pool_type: str
    label_shapes: list | None
    checkpoint_callback: Any
    inmemory_cache_all: bool
    data_module: Any
    continuous_cols: Any
    categorical_cols: Any
    backward_passes_per_step: int
    gradient_compression: str
    reader: str
    materialize: str
    reuse_data: str
    task: str
    mlflow: str  # normalized: 'auto' | 'on' | 'off'

    # The converters of an estimator whose Params differ (TorchEstimator's model, loss, ...): a subclass's.
    own_converters: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        conv = {**CONVERTERS, **self.own_converters}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                conv[f.name](value)
        if self.store is None:
            raise ValueError(
                "store is required: a path, URL or hvd_spark.Store reachable from every executor. Received: store=None."
            )
        if self.model is None:
            raise ValueError("model is required: a built Keras 3 model (torch: an nn.Module). Received: model=None.")
        if not self.feature_cols:
            raise ValueError(f"feature_cols must name at least one column. Received: feature_cols={self.feature_cols}.")
        if not self.label_cols:
            raise ValueError(f"label_cols must name at least one column. Received: label_cols={self.label_cols}.")
        if self.elastic:
            low, high = self.min_num_proc or 1, self.max_num_proc
            if high is not None and low > high:
                raise ValueError(
                    f"min_num_proc must be at most max_num_proc. Received: min_num_proc={low}, max_num_proc={high}."
                )
            if self.num_proc is not None and (self.num_proc < low or (high is not None and self.num_proc > high)):
                raise ValueError(
                    f"num_proc (the ranks to start with) must lie between min_num_proc={low} and "
                    f"max_num_proc={high}. Received: num_proc={self.num_proc}."
                )
            if self.max_restarts < 1:
                raise ValueError(
                    "min_num_proc / max_num_proc (elastic training) need max_restarts >= 1: continuing after a "
                    "lost rank is a restart of the training job on the slots left. "
                    f"Received: max_restarts={self.max_restarts}."
                )
        elif self.elastic_timeout is not None:
            raise ValueError("elastic_timeout applies to elastic training only: set min_num_proc or max_num_proc too.")
        if self.checkpoint_every is not None and self.reader == "petastorm":
            raise ValueError(
                "checkpoint_every (commits inside an epoch) needs reader='arrow', which records which rows each "
                "rank has read. Received: reader='petastorm'."
            )
        if self.mlflow not in MLFLOW_MODES:
            raise ValueError(f"mlflow must be 'auto', 'on' or 'off' in the record. Received: mlflow={self.mlflow!r}.")

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> "FitParams":
        """The record of ``{param name: value}`` (``getOrDefault`` of each Param); a name that is no
        field is an error, a missing one takes its default from :data:`DEFAULTS`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"Unknown HorovodEstimator parameters: {unknown}.")
        conv = {**CONVERTERS, **cls.own_converters}
        kw: dict[str, Any] = {k: (conv[k](v) if v is not None else None) for k, v in values.items()}
        for name in _NONE_IS_DEFAULT:  # horovod.spark's spelling of the default
            if kw.get(name) is None:
                kw[name] = DEFAULTS[name]
        kw["mlflow"] = normalized_mlflow(kw["mlflow"])
        for name in _NOT_NONE:
            if name in kw and kw[name] is None:  # a Param with a value that cannot be None, set to None
                raise TypeError(f"{name} must not be None. Received: {name}=None.")
        return cls(**{**DEFAULTS, **kw})

    def as_dict(self) -> dict[str, Any]:
        """``{param name: value}`` (a shallow copy: the model and objects are the same objects)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def elastic(self) -> bool:
        """Whether the fit is elastic: it goes on with fewer ranks after a loss and grows back."""
        return self.min_num_proc is not None or self.max_num_proc is not None

    @property
    def val_batch(self) -> int:
        """Rows per validation batch per rank: ``val_batch_size``, else ``batch_size``."""
        return self.val_batch_size or self.batch_size


# keras.Model.fit's arguments that are not HorovodEstimator.fit's: the Param that does their work.
KERAS_FIT_ARGUMENTS: dict[str, str] = {
    "x": "feature_cols (the DataFrame's feature columns)",
    "y": "label_cols (the DataFrame's label columns)",
    "batch_size": "batch_size (rows per step per rank)",
    "epochs": "epochs (the total of the run)",
    "verbose": "verbose",
    "callbacks": "callbacks",
    "validation_split": "validation (a fraction)",
    "validation_data": "validation (a fraction or a boolean column of the DataFrame)",
    "shuffle": "shuffle",
    "class_weight": "class_weight",
    "sample_weight": "sample_weight_col (a column of the DataFrame)",
    "steps_per_epoch": "train_steps_per_epoch",
    "validation_steps": "validation_steps_per_epoch",
    "validation_batch_size": "val_batch_size",
    "validation_freq": "validation_freq",
}


def fit_arguments_error(kwargs: Mapping[str, Any]) -> TypeError:
    """The error of ``HorovodEstimator.fit`` given keyword arguments of ``keras.Model.fit`` (or others):
    what fit takes, what it received, and the Param to set instead (``initial_epoch``: ``run_id``)."""
    received = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
    fixes = []
    for name in kwargs:
        if name == "initial_epoch":
            fixes.append(
                "initial_epoch: a fit resumes a run at its next epoch: pass the run's run_id= (HorovodEstimator("
                "run_id=...), or params={est.run_id: ...}); the epochs Param is the total number of epochs of the run"
            )
        elif name in KERAS_FIT_ARGUMENTS:
            param = KERAS_FIT_ARGUMENTS[name]
            fixes.append(f"{name}: set the estimator's Param {param}")
        else:
            fixes.append(f"{name}: not an argument of fit")
    return TypeError(
        "HorovodEstimator.fit takes the DataFrame and, optionally, params (a dict of Param values, as any Spark ML "
        f"Estimator's fit); keras.Model.fit's arguments are the estimator's Params. Received: {received}. "
        + "; ".join(fixes)
        + ". Set a Param in the constructor, with its setter (est.setBatchSize(64)) or as fit(df, params={est."
        "batch_size: 64})."
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"
