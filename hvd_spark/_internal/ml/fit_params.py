"""The estimator's parameters as one typed record (:class:`FitParams`), and the converters that check
each parameter when it is set.

Every converter takes a value that is not None (Spark ML's ``_set`` skips None; ``set`` does not, so
each accepts None too where None is allowed) and returns it, unchanged or normalized; a value of the
wrong type raises ``TypeError`` and one out of range or not among the choices ``ValueError``, each
naming the parameter and what it expects. ``fit`` builds the record once from the Params; the same
converters validate it, so a value can reach ``fit`` by no path that skips them.

Pure: no Spark, Keras or Horovod, so the fast tier tests it.
"""

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.choices import (
    BACKENDS,
    COMPRESSIONS,
    MATERIALIZE_MODES,
    MLFLOW_MODES,
    READERS,
    REUSE_MODES,
    TASKS,
)
from hvd_spark._internal.data.store import Store, validate_run_id

Converter = Callable[[Any], Any]


def _is_int(x) -> bool:
    """An integer (numpy's too), or a whole float such as 32.0 (what search spaces and JSON give)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, numbers.Integral):
        return True
    return isinstance(x, numbers.Real) and float(x).is_integer()


def _plain(x):
    """A number as Python's own int or float (numpy's are not JSON, and JSON feeds the data keys)."""
    return x if type(x) in (int, float) else float(x)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def int_at_least(name: str, low: int, *, optional: bool = False) -> Converter:
    """An integer >= ``low`` (or None when ``optional``)."""

    def conv(x):
        if x is None and optional:
            return None
        if not _is_int(x):
            raise TypeError(f"{name} must be an integer{' or None' if optional else ''}. Received: {x!r}.")
        if x < low:
            raise ValueError(
                f"{name} must be at least {low}{' (or None)' if optional else ''}. Received: {name}={x!r}."
            )
        return int(x)

    return conv


def any_int(name: str) -> Converter:
    def conv(x):
        if not _is_int(x):
            raise TypeError(f"{name} must be an integer. Received: {x!r}.")
        return int(x)

    return conv


def boolean(name: str, *, optional: bool = False) -> Converter:
    def conv(x):
        if x is None and optional:
            return None
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be True{', False or None' if optional else ' or False'}. Received: {x!r}.")
        return x

    return conv


def choice(name: str, choices: tuple[str, ...], expected: str | None = None) -> Converter:
    """One of ``choices`` (``expected``: how the message says so; default "one of [...]")."""
    expected = expected or f"one of {list(choices)}"

    def conv(x):
        if not isinstance(x, str):
            raise TypeError(f"{name} must be {expected}. Received: {x!r} ({type(x).__name__}).")
        if x not in choices:
            raise ValueError(f"{name} must be {expected}. Received: {name}={x!r}.")
        return x

    return conv


def backend_name(x):
    """``backend`` as a Param holds a controller's name; an object with ``run`` and ``num_processes``
    goes through the constructor, ``setParams`` or ``setBackend``, which keep it beside the Params."""
    if not isinstance(x, str):
        raise TypeError(
            "backend must be 'gloo', 'mpi' or an object with run(fn, args, kwargs, env) and num_processes() "
            f"(given to the constructor, setParams or setBackend). Received: {x!r}."
        )
    if x not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' or 'mpi'. Received: backend={x!r}.")
    return x


def is_backend_object(x) -> bool:
    """Whether ``x`` has horovod.spark's ``Backend`` shape: ``run`` and ``num_processes``."""
    return not isinstance(x, str) and callable(getattr(x, "run", None)) and callable(getattr(x, "num_processes", None))


def seconds(name: str) -> Converter:
    """A positive number of seconds (or None: the setting's default)."""

    def conv(x):
        if x is None:
            return None
        if not _is_number(x):
            raise ValueError(f"{name} must be a number of seconds. Received: {x!r}.")
        return settings.parse_seconds(name, x)

    return conv


def stall_seconds(x):
    """``stall_timeout``: 0 (no watchdog) or at least MIN_STALL_TIMEOUT seconds, or None (the default)."""
    if x is None:
        return None
    if not _is_number(x):
        raise ValueError(f"stall_timeout must be a number of seconds (0: no stall watchdog). Received: {x!r}.")
    settings.parse_stall_timeout("stall_timeout", x)  # the range check, with its message
    return float(x)


def mlflow_mode(x):
    """'auto' | 'on' | 'off' in any case, or True / False (on / off), or None (auto); kept as given."""
    if x is None or isinstance(x, bool):
        return x
    if not isinstance(x, str) or x.lower() not in MLFLOW_MODES:
        raise ValueError(f"mlflow must be 'auto', 'on' or 'off' (or True / False). Received: mlflow={x!r}.")
    return x


def normalized_mlflow(x) -> str:
    return {True: "on", False: "off", None: "auto"}[x] if not isinstance(x, str) else x.lower()


def optional_str(name: str) -> Converter:
    def conv(x):
        if x is None or isinstance(x, str):
            return x
        raise TypeError(f"{name} must be a string or None. Received: {x!r}.")

    return conv


def run_id(x):
    if x is None:
        return None
    if not isinstance(x, str):
        raise TypeError(f"run_id must be a string or None. Received: {x!r} ({type(x).__name__}).")
    return validate_run_id(x)


def store(x):
    if x is None or isinstance(x, (str, os.PathLike, Store)):
        return x
    raise TypeError(f"store must be a path, a URL or a hvd_spark.Store. Received: {type(x).__name__}.")


def model(x):
    """A Keras model, recognized by its methods (checked as a keras.Model when ``fit`` starts)."""
    if x is None or (callable(getattr(x, "get_weights", None)) and hasattr(x, "layers")):
        return x
    raise TypeError(f"model must be a keras.Model (Keras 3), built. Received: {type(x).__name__}.")


def optimizer(x):
    if x is None or isinstance(x, str) or callable(getattr(x, "get_config", None)):
        return x
    raise TypeError(f"optimizer must be a Keras optimizer or its name (e.g. 'adam'). Received: {x!r}.")


def _loss_entry(x) -> bool:
    return x is None or isinstance(x, str) or callable(x)


def loss(x):
    """A loss (name, function or Loss object), or a list / dict of them for several outputs."""
    if _loss_entry(x):
        return x
    if isinstance(x, (list, tuple)) and all(_loss_entry(v) for v in x):
        return x
    if isinstance(x, Mapping) and all(isinstance(k, str) and _loss_entry(v) for k, v in x.items()):
        return x
    raise TypeError(
        "loss must be a loss name, function or keras.losses.Loss, or a list or dict of them (one per output). "
        f"Received: {x!r}."
    )


def loss_weights(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)) and all(_is_number(v) for v in x):
        return [_plain(v) for v in x]
    if isinstance(x, Mapping) and all(isinstance(k, str) and _is_number(v) for k, v in x.items()):
        return {k: _plain(v) for k, v in x.items()}
    raise TypeError(f"loss_weights must be a list of numbers or a dict of output name -> number. Received: {x!r}.")


def metrics(x):
    if x is None or isinstance(x, (list, tuple, Mapping)):
        return x
    raise TypeError(
        f"metrics must be a list of metrics (names, functions or keras.metrics.Metric) or a dict of output "
        f"name -> metrics, as for keras.Model.compile. Received: {x!r}."
    )


def custom_objects(x):
    if x is None or (isinstance(x, dict) and all(isinstance(k, str) for k in x)):
        return x
    raise TypeError(f"custom_objects must be a dict of name -> class or function. Received: {x!r}.")


def class_weight(x):
    """Keras ``fit``'s ``class_weight``: ``{class index: weight}``, each weight a finite number >= 0."""
    if x is None:
        return None
    if not isinstance(x, Mapping) or not x:
        raise TypeError(f"class_weight must be a non-empty dict of class index -> weight. Received: {x!r}.")
    out = {}
    for k, v in x.items():
        key = int(k) if isinstance(k, str) and k.isdigit() else k  # JSON turns the keys into strings
        if not _is_int(key) or not _is_number(v):
            raise TypeError(
                f"class_weight must map class indices (integers) to weights (numbers). Received: {k!r}: {v!r}."
            )
        if key < 0 or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"class_weight must map class indices >= 0 to finite weights >= 0. Received: class_weight[{k!r}]={v!r}."
            )
        out[int(key)] = float(v)
    return out


def validation_freq(x):
    """Keras ``fit``'s ``validation_freq``: validate every N epochs (an int >= 1), or after the listed
    epochs (1-based)."""
    if _is_int(x):
        if x < 1:
            raise ValueError(f"validation_freq must be at least 1. Received: validation_freq={x!r}.")
        return int(x)
    if isinstance(x, (list, tuple)) and x and all(_is_int(e) for e in x):
        if min(x) < 1:
            raise ValueError(f"validation_freq lists epochs, counted from 1. Received: validation_freq={list(x)!r}.")
        return sorted({int(e) for e in x})
    raise TypeError(f"validation_freq must be an integer >= 1 or a non-empty list of epoch numbers. Received: {x!r}.")


def callbacks(x):
    if x is None or isinstance(x, (list, tuple)):
        return x
    raise TypeError(f"callbacks must be a list of keras.callbacks.Callback. Received: {type(x)}.")


def validation(x):
    if x is None or isinstance(x, str):
        return x
    if not _is_number(x):
        raise TypeError(f"validation must be a fraction in [0, 1) or a column name. Received: validation={x!r}.")
    if not 0 <= x < 1:
        raise ValueError(f"validation must be a fraction in [0, 1) or a column name. Received: validation={x!r}.")
    return _plain(x)


def verbosity(x):
    if not _is_int(x):
        raise TypeError(f"verbose must be 0, 1 or 2. Received: {x!r}.")
    if x not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2. Received: verbose={x!r}.")
    return int(x)


def columns(name: str, groups: bool = False) -> Converter:
    """A column-list param: a name, a list of names or a dict of model tensor name -> column. With
    ``groups``, an entry may also be a list of column names (scalar columns stacked into one input)."""

    def entry(c):
        if isinstance(c, str):
            return c
        if groups and isinstance(c, (list, tuple)) and c and all(isinstance(p, str) for p in c):
            return list(c)
        raise TypeError

    def conv(x):
        if x is None:
            return None
        if isinstance(x, str):
            return [x]
        try:
            if isinstance(x, (list, tuple)):
                return [entry(c) for c in x]
            if isinstance(x, dict) and all(isinstance(k, str) for k in x):
                return {k: entry(c) for k, c in x.items()}  # model tensor name (or dict key) -> column
        except TypeError:
            pass
        group = " (or a list of scalar columns to stack into one input)" if groups else ""
        raise TypeError(
            f"{name} must be a column name, a list of column names or a dict of model tensor name -> "
            f"column{group}. Received: {x!r}."
        )

    return conv


def positive_float(name: str) -> Converter:
    def conv(x):
        if x is None:
            return None
        if not _is_number(x) or not x > 0:
            raise TypeError(f"{name} must be a positive number or None. Received: {x!r}.")
        return float(x)

    return conv


def optional_choice(name: str, choices: tuple[str, ...]) -> Converter:
    """None or one of ``choices``."""
    inner = choice(name, choices)
    return lambda x: None if x is None else inner(x)


def reader_pool_type(x):
    """horovod.spark's ``reader_pool_type``: ``"thread"`` (reader threads) or ``"dummy"`` (read in the
    training loop's thread); ``"process"`` is refused: see the message."""
    x = choice("reader_pool_type", ("thread", "process", "dummy"))(x)
    if x == "process":
        raise ValueError(
            "reader_pool_type='process' is not supported: each rank reads its row groups with pyarrow in threads "
            "(pyarrow releases the GIL), and a process pool would copy every batch between processes. Use "
            "'thread' (the default) or 'dummy'."
        )
    return x


def optional_callable(name: str) -> Converter:
    def conv(x):
        if x is None or callable(x):
            return x
        raise TypeError(f"{name} must be a function or None. Received: {x!r} ({type(x).__name__}).")

    return conv


def label_shapes(x):
    """horovod.spark's ``label_shapes``: one shape per label column (a list of ints each), or None."""
    if x is None:
        return None
    if not isinstance(x, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(_is_int(d) and d >= 1 for d in s) for s in x
    ):
        raise TypeError(
            f"label_shapes must be a list of shapes, one per label column (lists of ints >= 1). Received: {x!r}."
        )
    return [[int(d) for d in s] for s in x]


def checkpoint_callback(x):
    """horovod.spark's ``checkpoint_callback``: a ``keras.callbacks.ModelCheckpoint`` (its ``monitor``,
    ``mode`` and ``save_best_only`` choose the model fit returns), or None."""
    if x is None:
        return None
    import keras

    if not isinstance(x, keras.callbacks.ModelCheckpoint):
        raise TypeError(
            f"checkpoint_callback must be a keras.callbacks.ModelCheckpoint or None. Received: {type(x).__name__}."
        )
    return x


def nvtabular(name: str) -> Converter:
    """horovod.spark's NVTabular params (``data_module``, ``continuous_cols``, ``categorical_cols``): None only."""

    def conv(x):
        if x is None:
            return None
        raise ValueError(
            f"{name} is not supported: it configures horovod.spark's NVTabular data module, which needs NVIDIA GPUs, "
            "cuDF and NVTabular; hvd_spark's ranks read Parquet with their own pyarrow reader. Leave it None and "
            "pass the columns as feature_cols (several scalar columns stack into one input)."
        )

    return conv


def environment(x):
    """``backend_env``: environment variables for every rank, ``{name: value}`` with string names and
    string (or number) values; None: none."""
    if x is None:
        return None
    if not isinstance(x, Mapping) or not all(isinstance(k, str) and k for k in x):
        raise TypeError(f"backend_env must be a dict of environment variable names to values. Received: {x!r}.")
    bad = {k: v for k, v in x.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)}
    if bad:
        raise TypeError(f"backend_env values must be strings or numbers. Received: {bad!r}.")
    return {k: str(v) for k, v in x.items()}


_EVERY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)\s*$")


def checkpoint_every(x):
    """``checkpoint_every``: a number of steps (an int >= 1), or a duration as a string: ``"90s"``,
    ``"10min"``, ``"1h"``; None: checkpoints at epoch ends only."""
    if x is None:
        return None
    if _is_number(x) and float(x) == int(x) and int(x) >= 1 and not isinstance(x, bool):
        return int(x)
    if isinstance(x, str) and _EVERY.match(x):
        return x.strip()
    raise ValueError(
        "checkpoint_every must be a number of steps (an integer >= 1) or a duration such as '90s', '10min' "
        f"or '1h'. Received: checkpoint_every={x!r}."
    )


def every_seconds(x) -> float | None:
    """The seconds of a ``checkpoint_every`` duration string (None for a number of steps)."""
    m = _EVERY.match(x) if isinstance(x, str) else None
    if m is None:
        return None
    return float(m.group(1)) * {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[m.group(2)]


# The converter of every estimator param: params.py gives each Param its own, FitParams checks with them.
CONVERTERS: dict[str, Converter] = {
    "num_proc": int_at_least("num_proc", 1, optional=True),
    "store": store,
    "model": model,
    "optimizer": optimizer,
    "learning_rate": positive_float("learning_rate"),
    "loss": loss,
    "loss_weights": loss_weights,
    "metrics": metrics,
    "custom_objects": custom_objects,
    "feature_cols": columns("feature_cols", groups=True),
    "label_cols": columns("label_cols"),
    "output_cols": columns("output_cols"),
    "sample_weight_col": optional_str("sample_weight_col"),
    "validation": validation,
    "callbacks": callbacks,
    "class_weight": class_weight,
    "validation_freq": validation_freq,
    "batch_size": int_at_least("batch_size", 1),
    "val_batch_size": int_at_least("val_batch_size", 1, optional=True),
    "epochs": int_at_least("epochs", 1),
    "train_steps_per_epoch": int_at_least("train_steps_per_epoch", 1, optional=True),
    "validation_steps_per_epoch": int_at_least("validation_steps_per_epoch", 1, optional=True),
    "shuffle": boolean("shuffle"),
    "shuffle_buffer_size": int_at_least("shuffle_buffer_size", 1),
    "random_seed": any_int("random_seed"),
    "run_id": run_id,
    "verbose": verbosity,
    "backend": backend_name,
    "start_timeout": seconds("start_timeout"),
    "stall_timeout": stall_seconds,
    "use_gpu": boolean("use_gpu", optional=True),
    "max_restarts": int_at_least("max_restarts", 0),
    "min_num_proc": int_at_least("min_num_proc", 1, optional=True),
    "max_num_proc": int_at_least("max_num_proc", 1, optional=True),
    "elastic_timeout": seconds("elastic_timeout"),
    "checkpoint_every": checkpoint_every,
    "backend_env": environment,
    "mp_start_method": optional_choice("mp_start_method", ("fork", "spawn", "forkserver")),
    "tensorflow_dataset_prefetch_buffer_size": int_at_least("tensorflow_dataset_prefetch_buffer_size", 0),
    "partitions_per_process": int_at_least("partitions_per_process", 1, optional=True),
    "transformation_fn": optional_callable("transformation_fn"),
    "train_reader_num_workers": int_at_least("train_reader_num_workers", 1),
    "val_reader_num_workers": int_at_least("val_reader_num_workers", 1),
    "reader_pool_type": reader_pool_type,
    "label_shapes": label_shapes,
    "checkpoint_callback": checkpoint_callback,
    "inmemory_cache_all": boolean("inmemory_cache_all"),
    "data_module": nvtabular("data_module"),
    "continuous_cols": nvtabular("continuous_cols"),
    "categorical_cols": nvtabular("categorical_cols"),
    "backward_passes_per_step": int_at_least("backward_passes_per_step", 1),
    "gradient_compression": choice("gradient_compression", COMPRESSIONS, "'none' or 'fp16'"),
    "reader": choice("reader", READERS),
    "materialize": choice("materialize", MATERIALIZE_MODES),
    "reuse_data": choice("reuse_data", REUSE_MODES),
    "task": choice("task", TASKS),
    "mlflow": mlflow_mode,
}


# Params whose value is never None (each has a default).
_NOT_NONE = (
    "batch_size",
    "epochs",
    "shuffle",
    "shuffle_buffer_size",
    "random_seed",
    "verbose",
    "max_restarts",
    "backward_passes_per_step",
    "gradient_compression",
    "reader",
    "reuse_data",
    "materialize",
    "task",
    "tensorflow_dataset_prefetch_buffer_size",
    "train_reader_num_workers",
    "val_reader_num_workers",
    "reader_pool_type",
    "inmemory_cache_all",
    "validation_freq",
)


@dataclasses.dataclass(frozen=True)
class FitParams:
    """The estimator's Params, as ``fit`` reads them: built once (:meth:`from_params`) when ``fit``
    starts, every value checked by its converter and the required ones present. Field names are the
    Param names; the docs of the values are the Params' (``HorovodEstimator``'s docstring).

    ``feature_cols``, ``label_cols`` and ``output_cols`` are the lists the user gave until ``fit``
    matched them to the model (``dataclasses.replace`` with the model's order)."""

    store: Any  # a path, URL or Store (required)
    model: Any  # a Keras model (required)
    feature_cols: Any  # list of names (or of name lists) or dict (required)
    label_cols: Any  # (required)
    num_proc: int | None = None
    optimizer: Any = None
    learning_rate: float | None = None
    loss: Any = None
    loss_weights: Any = None
    metrics: Any = None
    custom_objects: dict[str, Any] | None = None
    output_cols: Any = None
    sample_weight_col: str | None = None
    validation: float | str | None = None
    callbacks: list | tuple | None = None
    class_weight: dict[int, float] | None = None
    validation_freq: int | list[int] = 1
    batch_size: int = 32
    val_batch_size: int | None = None
    epochs: int = 1
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    shuffle: bool = True
    shuffle_buffer_size: int = 10000
    random_seed: int = 0
    run_id: str | None = None
    verbose: int = 1
    backend: str = "gloo"  # the controller's name; a backend object stays on the estimator
    start_timeout: float | None = None
    stall_timeout: float | None = None
    use_gpu: bool | None = None
    max_restarts: int = 0
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    elastic_timeout: float | None = None
    checkpoint_every: int | str | None = None
    backend_env: dict[str, str] | None = None
    mp_start_method: str | None = None
    tensorflow_dataset_prefetch_buffer_size: int = 0
    partitions_per_process: int | None = None
    transformation_fn: Any = None
    train_reader_num_workers: int = 2
    val_reader_num_workers: int = 2
    reader_pool_type: str = "thread"
    label_shapes: list | None = None
    checkpoint_callback: Any = None
    inmemory_cache_all: bool = False
    data_module: Any = None
    continuous_cols: Any = None
    categorical_cols: Any = None
    backward_passes_per_step: int = 1
    gradient_compression: str = "none"
    reader: str = "arrow"
    materialize: str = "auto"
    reuse_data: str = "auto"
    task: str = "auto"
    mlflow: str = "auto"  # normalized: 'auto' | 'on' | 'off'

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                CONVERTERS[f.name](value)
        if self.store is None:
            raise ValueError(
                "store is required: a path, URL or hvd_spark.Store reachable from every executor. Received: store=None."
            )
        if self.model is None:
            raise ValueError("model is required: a built Keras 3 model. Received: model=None.")
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
        field is an error, a missing one takes the field's default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"Unknown HorovodEstimator parameters: {unknown}.")
        kw: dict[str, Any] = {k: (CONVERTERS[k](v) if v is not None else None) for k, v in values.items()}
        kw["mlflow"] = normalized_mlflow(kw.get("mlflow", "auto"))
        if kw.get("backend", "gloo") is None:  # horovod.spark's default spelling
            kw["backend"] = "gloo"
        for name in _NOT_NONE:
            if name in kw and kw[name] is None:  # a Param with a value that cannot be None, set to None
                raise TypeError(f"{name} must not be None. Received: {name}=None.")
        return cls(**kw)

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
