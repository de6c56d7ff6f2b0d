"""Turns Keras objects and Python callables into bytes that cross process boundaries and disk."""

import contextlib
import os
import tempfile
from typing import Any

import cloudpickle

from hvd_spark._internal.common import functions


def dumps_keras_obj(obj: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    """A picklable form of a loss / metric / optimizer: strings as they are, Keras objects as their
    config (Keras objects hold variables that do not pickle), a function shipped in ``custom_objects``
    by its name there (the receiver uses that very object: see ``common/functions.py``), anything else
    cloudpickled."""
    import keras

    if obj is None or isinstance(obj, (str, int, float, bool)):
        return ("plain", obj)
    if isinstance(obj, (list, tuple)):
        return ("list", [dumps_keras_obj(o, custom_objects) for o in obj])
    if isinstance(obj, dict):
        return ("dict", {k: dumps_keras_obj(v, custom_objects) for k, v in obj.items()})
    shipped = [k for k, v in (custom_objects or {}).items() if v is obj and k.startswith(functions.PACKAGE + ">")]
    if shipped:
        return ("custom", shipped[0])
    if isinstance(obj, (keras.optimizers.Optimizer, keras.losses.Loss, keras.metrics.Metric)):
        return ("keras", keras.saving.serialize_keras_object(obj))
    return ("pickle", cloudpickle.dumps(obj))


def loads_keras_obj(data: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    import keras

    kind, value = data
    if kind == "plain":
        return value
    if kind == "list":
        return [loads_keras_obj(v, custom_objects) for v in value]
    if kind == "dict":
        return {k: loads_keras_obj(v, custom_objects) for k, v in value.items()}
    if kind == "keras":
        return keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
    if kind == "custom":
        return (custom_objects or {})[value]
    return cloudpickle.loads(value)


def model_custom_objects(model, custom_objects: dict[str, Any] | None, params: Any = ()) -> dict[str, Any]:
    """The custom objects that loading ``model`` needs in a process that may not import their modules.

    Starts from the user's ``custom_objects`` (also keyed by each object's registered name, e.g.
    ``"my_package>MyLayer"``, which is what a saved file names), and adds:

    - every object of Keras' global registry (``@keras.saving.register_keras_serializable``) that the
      model's configuration (its own class included), its compile configuration or ``params`` (the
      optimizer, loss and metrics given to the estimator) name;
    - every class or function not from Keras that the model, its layers (their initializers,
      regularizers, activations, ...), its optimizer, loss and metrics, or ``params`` are made of,
      keyed by the name a saved file gives it.

    The result is cloudpickled to the ranks and to ``transform``: classes defined in the driver's
    ``__main__`` (a script, a notebook) travel by value, so they load where their module does not exist.
    Python lambdas (``Lambda`` layers', a lambda loss) and functions that share a name (closures of one
    factory) are keyed by names of their own (``common/functions.py``), with the lambdas' saved forms
    under ``functions.LAMBDA_CODES``.
    """
    import inspect

    import keras

    out: dict[str, Any] = dict(custom_objects or {})
    for obj in list(out.values()):
        with contextlib.suppress(Exception):  # not a class or function Keras can name: keep as given
            out.setdefault(keras.saving.get_registered_name(obj), obj)
    configs: list[Any] = []
    for obj in [model, *_flat(params)]:
        with contextlib.suppress(Exception):  # a subclassed model without get_config, a plain string
            configs.append(keras.saving.serialize_keras_object(obj))
    with contextlib.suppress(Exception):  # an uncompiled model has no compile config
        configs.append(model.get_compile_config())
    registry = keras.saving.get_custom_objects()
    for name in _registered_names(configs):
        if name in registry:
            out.setdefault(name, registry[name])
    user = _user_objects(model, params)
    fns = [f for f in user if inspect.isfunction(f)] + functions.lambda_layer_functions(model)
    unique = functions.unique_names(fns, out)  # lambdas, and closures sharing a name: each its own
    for item in [*user, *(f for f in fns if f not in user)]:
        with contextlib.suppress(Exception):
            name = unique.get(id(item)) or keras.saving.get_registered_name(item)
            if ">" not in name and not isinstance(item, type) and _keras_knows(name):
                continue  # a function named like a Keras one ("gelu", "mse"): it would replace Keras' everywhere
            out.setdefault(name, item)
    codes = functions.lambda_codes(out)
    if codes:
        out[functions.LAMBDA_CODES] = codes
    return out


def _keras_knows(name: str) -> bool:
    """Whether Keras resolves ``name`` itself (an activation, loss or metric of its own)."""
    import keras

    for get in (keras.activations.get, keras.losses.get, keras.metrics.get):
        try:
            get(name)
            return True
        except (ValueError, TypeError):
            continue
    return False


def _flat(obj) -> list:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _flat(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _flat(v)]
    return [] if obj is None or isinstance(obj, (str, int, float, bool)) else [obj]


def _user_objects(model, params) -> list:
    """The classes and functions not from Keras that ``model`` and ``params`` are made of."""
    import inspect

    seen: list[Any] = []

    def add(obj) -> None:
        kind = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
        module = getattr(kind, "__module__", "") or ""
        if module.split(".")[0] in ("keras", "tensorflow", "builtins", "numpy", "tf_keras") or kind in seen:
            return
        seen.append(kind)

    layers = list(model._flatten_layers(include_self=True)) if hasattr(model, "_flatten_layers") else [model]
    compiled = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    roots = [*layers, getattr(model, "optimizer", None), getattr(model, "loss", None), *_flat(compiled)]
    for obj in [*roots, *_flat(params)]:
        if obj is None or isinstance(obj, (str, int, float, bool)):
            continue
        add(obj)
        parts = vars(obj).values() if hasattr(obj, "__dict__") and not inspect.isclass(obj) else ()
        for part in parts:  # a layer's initializers, regularizers, activation; an optimizer's schedule
            for leaf in _flat(part) if isinstance(part, (list, tuple, dict)) else [part]:
                if _named_function(leaf) or _is_keras_part(leaf):
                    add(leaf)
    return seen


def _named_function(obj) -> bool:
    """A function Keras saves by name (an activation, a loss): defined at a module's top level, not a
    method, a closure (Keras' wrappers of a layer's own methods hold the layer) or a lambda."""
    import inspect

    name = getattr(obj, "__qualname__", "")
    return inspect.isfunction(obj) and obj.__closure__ is None and "." not in name and not name.startswith("<")


def _is_keras_part(obj) -> bool:
    import keras

    kinds = (
        keras.initializers.Initializer,
        keras.regularizers.Regularizer,
        keras.constraints.Constraint,
        keras.losses.Loss,
        keras.metrics.Metric,
        keras.optimizers.schedules.LearningRateSchedule,
    )
    return isinstance(obj, kinds)


def register_custom_objects(custom_objects: dict[str, Any] | None) -> None:
    """Registers objects keyed ``"package>name"`` in this process's Keras registry, as their
    ``@register_keras_serializable`` did on the driver (a class shipped by value to another
    process arrives without its registration), so that files saved here name them the same way."""
    import keras

    for key, obj in (custom_objects or {}).items():
        if key.startswith(functions.PACKAGE + ">"):
            continue  # keys of each load's custom objects only (a rank registers them: functions.adopt)
        if ">" in key and key not in keras.saving.get_custom_objects():
            package, name = key.split(">", 1)
            with contextlib.suppress(ValueError):  # not a serializable class (no get_config): leave it
                keras.saving.register_keras_serializable(package=package, name=name)(obj)


def _registered_names(config) -> set:
    names = set()
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            name = item.get("registered_name")
            if isinstance(name, str):
                names.add(name)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return names


# The attribute where ``rank/optimizer.py``'s ``make_distributed`` keeps a distributed optimizer's
# original class.
DIST_BASE_ATTR = "_hvd_spark_base_class"


@contextlib.contextmanager
def plain_class(optimizer):
    """Within the block, ``optimizer`` is an instance of its original class (for saving)."""
    base = getattr(optimizer, DIST_BASE_ATTR, None) if optimizer is not None else None
    if base is None:
        yield optimizer
        return
    dist = type(optimizer)
    optimizer.__class__ = base
    try:
        yield optimizer
    finally:
        optimizer.__class__ = dist


def save_model_file(model, path: str) -> None:
    """Writes ``model`` as a local ``.keras`` file: the one way hvd_spark saves a model.

    A distributed optimizer is saved under its original class, so that the file loads in plain
    Keras (and, for checkpoints, on the ranks, which wrap it again).
    """
    with plain_class(getattr(model, "optimizer", None)):
        model.save(path)


def model_to_bytes(model, custom_objects: dict[str, Any] | None = None) -> bytes:
    """The model as a ``.keras`` file's bytes (architecture, weights, compile config, optimizer); the
    functions shipped in ``custom_objects`` are saved by their names there."""
    with tempfile.TemporaryDirectory() as d, functions.names_registered(custom_objects):
        path = os.path.join(d, "model.keras")
        save_model_file(model, path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any] | None = None, compile: bool = True):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return load_model_file(path, custom_objects=custom_objects, compile=compile)


def load_model_file(
    path: str,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
    storage_options: dict[str, Any] | None = None,
):
    """Loads a ``.keras`` file: the one way hvd_spark loads a model.

    ``path`` is a local path or any fsspec URL (``s3://...`` with ``storage_options``); a remote
    file is copied to a temporary local file first, since Keras reads local files only.
    Registered custom objects are registered again in this process before loading; the lambdas the
    driver shipped replace the bytecode it saved for them (``common/functions.py``), so a model with
    ``Lambda`` layers loads in Keras' safe mode.
    """
    import keras

    register_custom_objects(custom_objects)
    fs = None
    if "://" in path:
        import fsspec

        fs, fs_path = fsspec.core.url_to_fs(path, **(storage_options or {}))
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        if "file" in protocols or "local" in protocols:
            path, fs = fs_path, None
    with tempfile.TemporaryDirectory() as d:
        if fs is not None:
            local = os.path.join(d, "model.keras")
            fs.get_file(fs_path, local)
            path = local
        if (custom_objects or {}).get(functions.LAMBDA_CODES):
            path = _with_shipped_lambdas(path, custom_objects, os.path.join(d, "resolved.keras"))
        return keras.models.load_model(path, custom_objects=custom_objects, compile=compile)


def _with_shipped_lambdas(path: str, custom_objects: dict[str, Any] | None, out: str) -> str:
    """``path``, or a copy at ``out`` whose config.json refers to the shipped lambdas in place of the
    bytecode the driver saved for them (``functions.resolve_lambdas``)."""
    import json
    import shutil
    import zipfile

    with zipfile.ZipFile(path) as z:
        config = json.loads(z.read("config.json"))
        if not functions.resolve_lambdas(config, custom_objects):
            return path
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
            for info in z.infolist():
                if info.filename == "config.json":
                    w.writestr(info, json.dumps(config).encode())
                    continue
                with z.open(info) as src, w.open(info, "w") as dst:  # the weights streamed, not held
                    shutil.copyfileobj(src, dst, 8 << 20)
    return out
