"""The converters that check each of the estimator's parameters when it is set, one per Param
(:data:`CONVERTERS`); ``FitParams`` (fit_params.py) checks its record with the same ones.

Every converter takes a value that is not None (Spark ML's ``_set`` skips None; ``set`` does not, so
each accepts None too where None is allowed) and returns it, unchanged or normalized. One rule for
all, each error naming the parameter and what it expects:

- ``TypeError``: a value of the wrong type: a string where a number is expected, a list where a
  dict is, and a bool where a number is (``True`` is no batch size, although Python's bool is an
  int);
- ``ValueError``: a value of the right type that the parameter cannot take: a number out of range
  (0 for a positive one, a negative count), not whole where a count is expected (2.5), not finite
  (inf, nan) where a finite one is, a string not among the choices or of the wrong form.

Integers may come as floats (``32.0``, what search spaces and JSON give) and as numpy's numbers;
they are returned as Python's own.

Pure: no Spark, Keras or Horovod, so the fast tier tests it.
"""

import math
import numbers
import os
import re
import sys
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


def _is_number(x) -> bool:
    """A real number (numpy's too), not a bool: the type of every numeric parameter."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_whole(x) -> bool:
    """A number that is an integer (numpy's too), or a whole float such as 32.0; not inf or nan."""
    return isinstance(x, numbers.Integral) or math.isfinite(x) and float(x).is_integer()


def _plain(x):
    """A number as Python's own int or float (numpy's are not JSON, and JSON feeds the data keys)."""
    return x if type(x) in (int, float) else float(x)


def int_at_least(name: str, low: int, *, optional: bool = False) -> Converter:
    """An integer >= ``low`` (or None when ``optional``)."""

    def conv(x):
        if x is None and optional:
            return None
        if not _is_number(x):
            raise TypeError(f"{name} must be an integer{' or None' if optional else ''}. Received: {x!r}.")
        if not _is_whole(x):
            raise ValueError(f"{name} must be an integer{' or None' if optional else ''}. Received: {name}={x!r}.")
        if x < low:
            raise ValueError(
                f"{name} must be at least {low}{' (or None)' if optional else ''}. Received: {name}={x!r}."
            )
        return int(x)

    return conv


def any_int(name: str) -> Converter:
    def conv(x):
        if not _is_number(x):
            raise TypeError(f"{name} must be an integer. Received: {x!r}.")
        if not _is_whole(x):
            raise ValueError(f"{name} must be an integer. Received: {name}={x!r}.")
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
            raise TypeError(f"{name} must be a number of seconds. Received: {x!r}.")
        return settings.parse_seconds(name, x)  # the range check (> 0, finite), with its message

    return conv


def stall_seconds(x):
    """``stall_timeout``: 0 (no watchdog) or at least MIN_STALL_TIMEOUT seconds, or None (the default)."""
    if x is None:
        return None
    if not _is_number(x):
        raise TypeError(f"stall_timeout must be a number of seconds (0: no stall watchdog). Received: {x!r}.")
    if not math.isfinite(x):
        raise ValueError(f"stall_timeout must be a finite number of seconds (0: off). Received: stall_timeout={x!r}.")
    settings.parse_stall_timeout("stall_timeout", x)  # the range check, with its message
    return float(x)


def mlflow_mode(x):
    """'auto' | 'on' | 'off' in any case, or True / False (on / off), or None (auto); kept as given."""
    if x is None or isinstance(x, bool):
        return x
    expected = "mlflow must be 'auto', 'on' or 'off' (or True / False)."
    if not isinstance(x, str):
        raise TypeError(f"{expected} Received: {x!r} ({type(x).__name__}).")
    if x.lower() not in MLFLOW_MODES:
        raise ValueError(f"{expected} Received: mlflow={x!r}.")
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
        out: Any = [_plain(v) for v in x]
    elif isinstance(x, Mapping) and all(isinstance(k, str) and _is_number(v) for k, v in x.items()):
        out = {k: _plain(v) for k, v in x.items()}
    else:
        raise TypeError(f"loss_weights must be a list of numbers or a dict of output name -> number. Received: {x!r}.")
    if not all(math.isfinite(v) for v in (out.values() if isinstance(out, dict) else out)):
        raise ValueError(f"loss_weights must be finite numbers. Received: loss_weights={x!r}.")
    return out


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
    if not isinstance(x, Mapping):
        raise TypeError(f"class_weight must be a non-empty dict of class index -> weight. Received: {x!r}.")
    if not x:
        raise ValueError(f"class_weight must be a non-empty dict of class index -> weight. Received: {x!r}.")
    out = {}
    for k, v in x.items():
        key = int(k) if isinstance(k, str) and k.isdigit() else k  # JSON turns the keys into strings
        if not _is_number(key) or not _is_number(v):
            raise TypeError(
                f"class_weight must map class indices (integers) to weights (numbers). Received: {k!r}: {v!r}."
            )
        if not _is_whole(key) or key < 0 or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"class_weight must map class indices >= 0 to finite weights >= 0. Received: class_weight[{k!r}]={v!r}."
            )
        out[int(key)] = float(v)
    return out


def validation_freq(x):
    """Keras ``fit``'s ``validation_freq``: validate every N epochs (an int >= 1), or after the listed
    epochs (1-based)."""
    expected = "validation_freq must be an integer >= 1 or a non-empty list of epoch numbers"
    if _is_number(x):
        if not _is_whole(x) or x < 1:
            raise ValueError(f"{expected}. Received: validation_freq={x!r}.")
        return int(x)
    if not isinstance(x, (list, tuple)) or not all(_is_number(e) for e in x):
        raise TypeError(f"{expected}. Received: {x!r}.")
    if not x or not all(_is_whole(e) for e in x):
        raise ValueError(f"{expected}. Received: validation_freq={x!r}.")
    if min(x) < 1:
        raise ValueError(f"validation_freq lists epochs, counted from 1. Received: validation_freq={list(x)!r}.")
    return sorted({int(e) for e in x})


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
    if not _is_number(x):
        raise TypeError(f"verbose must be 0, 1 or 2. Received: {x!r}.")
    if x not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2. Received: verbose={x!r}.")
    return int(x)


def columns(name: str, groups: bool = False) -> Converter:
    """A column-list param: a name, a list of names or a dict of model tensor name -> column. With
    ``groups``, an entry may also be a list of column names (scalar columns stacked into one input, or
    one output's label)."""

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
        tensor = "output" if name == "label_cols" else "input"
        group = f" (or a list of scalar columns to stack into one {tensor})" if groups else ""
        raise TypeError(
            f"{name} must be a column name, a list of column names or a dict of model tensor name -> "
            f"column{group}. Received: {x!r}."
        )

    return conv


def positive_float(name: str) -> Converter:
    def conv(x):
        if x is None:
            return None
        if not _is_number(x):
            raise TypeError(f"{name} must be a positive number or None. Received: {x!r}.")
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"{name} must be a positive number or None. Received: {name}={x!r}.")
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
    expected = "label_shapes must be a list of shapes, one per label column (lists of ints >= 1)"
    if not isinstance(x, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(_is_number(d) for d in s) for s in x
    ):
        raise TypeError(f"{expected}. Received: {x!r}.")
    if not all(_is_whole(d) and d >= 1 for s in x for d in s):
        raise ValueError(f"{expected}. Received: label_shapes={x!r}.")
    return [[int(d) for d in s] for s in x]


def checkpoint_callback(x):
    """horovod.spark's ``checkpoint_callback``: a ``keras.callbacks.ModelCheckpoint`` (its ``monitor``,
    ``mode`` and ``save_best_only`` choose the model fit returns), or None."""
    if x is None:
        return None
    keras = sys.modules.get("keras")  # not imported here: without Keras loaded, x is no ModelCheckpoint
    if keras is None or not isinstance(x, keras.callbacks.ModelCheckpoint):
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
    if not isinstance(x, Mapping) or not all(isinstance(k, str) for k in x):
        raise TypeError(f"backend_env must be a dict of environment variable names to values. Received: {x!r}.")
    bad = {k: v for k, v in x.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)}
    if bad:
        raise TypeError(f"backend_env values must be strings or numbers. Received: {bad!r}.")
    names = [k for k in x if not k or "=" in k or "\0" in k]
    if names:
        raise ValueError(f"backend_env names must be non-empty, without '=' or NUL. Received: {names!r}.")
    return {k: str(v) for k, v in x.items()}


_EVERY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)\s*$")


def checkpoint_every(x):
    """``checkpoint_every``: a number of steps (an int >= 1), or a duration as a string: ``"90s"``,
    ``"10min"``, ``"1h"``; None: checkpoints at epoch ends only."""
    expected = (
        "checkpoint_every must be a number of steps (an integer >= 1) or a duration such as '90s', '10min' or '1h'"
    )
    if x is None:
        return None
    if _is_number(x):
        if _is_whole(x) and x >= 1:
            return int(x)
    elif isinstance(x, str):
        if _EVERY.match(x):
            return x.strip()
    else:
        raise TypeError(f"{expected}. Received: {x!r} ({type(x).__name__}).")
    raise ValueError(f"{expected}. Received: checkpoint_every={x!r}.")


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
    "label_cols": columns("label_cols", groups=True),
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
    "keep_checkpoints": int_at_least("keep_checkpoints", 1, optional=True),
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
