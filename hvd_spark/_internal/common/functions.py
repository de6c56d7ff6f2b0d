"""The user's Python functions (lambdas, closures) as they travel with a model: by value, each under a
name of its own.

Keras saves a function by its name, so two closures from one factory (``make_loss(1.0)``,
``make_loss(4.0)``, both ``loss_fn``) become one when the file is loaded; and it saves a Python lambda
(a ``Lambda`` layer's function, a lambda loss) as its bytecode, which it loads only outside safe mode
and without the globals the lambda reads. hvd_spark ships every such function by value (cloudpickle,
inside the custom objects) under a name of its own, ``hvd_spark_fn>...``:

- on the driver, the model is saved with those names registered (:func:`names_registered`), so its
  compile configuration names each closure apart;
- where a file is loaded (:func:`resolve_lambdas`), every ``__lambda__`` entry that the driver wrote
  for a shipped lambda (matched by its bytecode as the driver's Python wrote it) is replaced by a
  reference to the shipped function: no code from the file runs, and Keras' safe mode stays on;
- in a process that trains and saves (a rank), the shipped copies take their names
  (:func:`adopt`), so what it saves names them and loads anywhere they are shipped. Elsewhere (the
  driver, ``transform``'s workers) the names are only keys of the custom objects given to each load:
  nothing of the user's is registered in Keras' registry.

A name holds a digest of the function, so one name is one function in every fit and every process.
"""

import contextlib
import inspect
import json
import threading
from typing import Any

PACKAGE = "hvd_spark_fn"
LAMBDA_CODES = "__hvd_spark_lambda_codes__"  # {name: the lambda's saved bytecode}: a custom object of no class


def is_lambda(obj) -> bool:
    return inspect.isfunction(obj) and obj.__name__ == "<lambda>"


def lambda_layer_functions(model) -> list:
    """The Python lambdas of ``model``'s ``Lambda`` layers (function, output_shape, mask)."""
    import keras

    layers = list(model._flatten_layers(include_self=False)) if hasattr(model, "_flatten_layers") else []
    found = []
    for layer in layers:
        if isinstance(layer, keras.layers.Lambda):
            for attr in ("function", "_output_shape", "mask"):
                value = getattr(layer, attr, None)
                if is_lambda(value):
                    found.append(value)
    return found


def unique_names(functions: list, taken: dict[str, Any]) -> dict[int, str]:
    """Names for the functions that Keras' own name would not tell apart: every lambda, and every
    function whose name another one (in ``functions`` or ``taken``) already has. ``{id(fn): name}``.

    A name holds a digest of the function's pickled form (code, closure, defaults, the globals it
    reads): one name is one function in every process and every fit, so models of several fits load
    side by side (a name counted per fit would give a second model the first one's function)."""
    names: dict[int, str] = {}
    owners: dict[str, int] = {k: id(v) for k, v in taken.items()}
    for fn in functions:
        if id(fn) in names:
            continue
        own = getattr(fn, "__name__", "")
        if not is_lambda(fn) and owners.setdefault(own, id(fn)) == id(fn):
            continue
        names[id(fn)] = f"{PACKAGE}>{'lambda' if is_lambda(fn) else own}_{_digest(fn)}"
    return names


def _digest(fn) -> str:
    import hashlib

    import cloudpickle

    try:
        data = cloudpickle.dumps(fn)
    except Exception:  # not picklable: checks._check_shipped names it; any distinct name serves meanwhile
        data = repr((fn.__module__, fn.__qualname__, id(fn))).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def lambda_codes(named: dict[str, Any]) -> dict[str, str]:
    """The bytecode Keras saves for each shipped lambda (``func_dump``'s base64 code, as the driver's
    Python writes it), by its name: what :func:`resolve_lambdas` matches."""
    from keras.src.utils import python_utils

    return {name: python_utils.func_dump(fn)[0] for name, fn in named.items() if is_lambda(fn)}


_REGISTRY_LOCK = threading.RLock()  # fits on threads of one driver (CrossValidator's parallelism) save alike


@contextlib.contextmanager
def names_registered(custom_objects: dict[str, Any] | None):
    """Within the block, Keras saves each shipped function (a ``hvd_spark_fn>`` name) by that name.
    Other threads' saves wait (Keras' registry is one dict of the process)."""
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    shipped = {key: fn for key, fn in (custom_objects or {}).items() if key.startswith(PACKAGE + ">")}
    with _REGISTRY_LOCK:
        before = {fn: names[fn] for fn in shipped.values() if fn in names}
        for key, fn in shipped.items():
            names[fn] = key
        try:
            yield
        finally:
            for fn in shipped.values():
                names.pop(fn, None)
            names.update(before)


def adopt(custom_objects: dict[str, Any] | None) -> None:
    """In a process that trains and saves (a rank): the shipped copies take their names, so what it
    saves names them (a lambda is renamed too: Keras saves a function named ``<lambda>`` as bytecode).
    Registered in this process's Keras registry, over any earlier entry of the name."""
    from keras.src.saving import object_registration

    for key, fn in (custom_objects or {}).items():
        if not key.startswith(PACKAGE + ">") or not inspect.isfunction(fn):
            continue
        if is_lambda(fn):
            fn.__name__ = fn.__qualname__ = key.split(">", 1)[1]
        object_registration.GLOBAL_CUSTOM_OBJECTS[key] = fn
        object_registration.GLOBAL_CUSTOM_NAMES[fn] = key


def resolve_lambdas(config, custom_objects: dict[str, Any] | None) -> int:
    """Replaces, in a model's parsed config.json, every ``__lambda__`` entry whose bytecode is that of a
    shipped lambda by a reference to it (by name, through the custom objects). Returns how many.

    Lambdas of one code (a factory's) differ by their closures: where several shipped lambdas have an
    entry's code, the closure and defaults decide, compared as Keras writes them (JSON); an entry that
    matches none, or more than one, is left as it is (Keras' safe mode refuses it, naming the way out)."""
    shipped = custom_objects or {}
    codes = shipped.get(LAMBDA_CODES) or {}
    replaced = 0
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        if item.get("class_name") == "__lambda__" and isinstance(item.get("config"), dict):
            name = _match(item["config"], codes, shipped)
            if name is not None:
                item.clear()
                item.update({"module": "builtins", "class_name": "function", "config": name, "registered_name": name})
                replaced += 1
                continue
        stack.extend(item.values())
    return replaced


def _match(inner: dict, codes: dict[str, str], shipped: dict[str, Any]) -> str | None:
    """The shipped lambda a saved ``__lambda__`` config is (``{"value": [code, defaults, closure]}``
    for a serialized function, ``{"code", "defaults", "closure"}`` for a Lambda layer's), or None."""
    value = inner["value"] if "value" in inner else [inner.get("code"), inner.get("defaults"), inner.get("closure")]
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        return None
    candidates = [name for name, code in codes.items() if code == value[0]]
    if len(candidates) > 1:
        saved = _comparable(value[1:])
        candidates = [n for n in candidates if _comparable(_parts(shipped.get(n))) == saved]
    return candidates[0] if len(candidates) == 1 else None


def _parts(fn) -> list:
    """A lambda's defaults and closure values as Keras' saving writes them."""
    from keras.src.saving import serialization_lib
    from keras.src.utils import python_utils

    try:
        _, defaults, closure = python_utils.func_dump(fn)
        return [serialization_lib.serialize_keras_object(defaults), serialization_lib.serialize_keras_object(closure)]
    except Exception:  # not a lambda Keras can describe: matches nothing
        return [object()]


def _comparable(parts) -> str:
    try:
        return json.dumps(parts, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(parts)
