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
  for a shipped lambda (matched by its bytecode as the driver saw it) is replaced by a reference to the
  shipped function: no code from the file runs, and Keras' safe mode stays on;
- in a process that trains and saves (a rank), the shipped copies take their names
  (:func:`adopt`), so what it saves names them and loads anywhere they are shipped.
"""

import contextlib
import inspect
import json
from typing import Any

PACKAGE = "hvd_spark_fn"
LAMBDA_CODES = "__hvd_spark_lambda_codes__"  # {name: the lambda's saved form}: a custom object of no class


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
    function whose name another one (in ``functions`` or ``taken``) already has. ``{id(fn): name}``."""
    names: dict[int, str] = {}
    owners: dict[str, int] = {k: id(v) for k, v in taken.items()}
    count = 0
    for fn in functions:
        if id(fn) in names:
            continue
        own = getattr(fn, "__name__", "")
        if not is_lambda(fn) and owners.setdefault(own, id(fn)) == id(fn):
            continue
        base = "lambda" if is_lambda(fn) else own
        while f"{PACKAGE}>{base}_{count}" in taken:
            count += 1
        names[id(fn)] = f"{PACKAGE}>{base}_{count}"
        count += 1
    return names


def saved_form(fn) -> list:
    """A lambda as Keras writes it into a model's config.json: ``[code, defaults, closure]``."""
    from keras.src.utils import python_utils

    return json.loads(json.dumps(list(python_utils.func_dump(fn)), default=str))


def lambda_codes(named: dict[str, Any]) -> dict[str, list]:
    """The saved form of each shipped lambda, by its name (what :func:`resolve_lambdas` matches)."""
    codes = {}
    for name, fn in named.items():
        if is_lambda(fn):
            with contextlib.suppress(Exception):  # a closure over a value JSON cannot hold: not matchable
                codes[name] = saved_form(fn)
    return codes


@contextlib.contextmanager
def names_registered(custom_objects: dict[str, Any] | None):
    """Within the block, Keras saves each shipped function (a ``hvd_spark_fn>`` name) by that name."""
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    added = [
        fn
        for key, fn in (custom_objects or {}).items()
        if key.startswith(PACKAGE + ">") and inspect.isfunction(fn) and fn not in names
    ]
    for fn in added:
        names[fn] = next(k for k, v in custom_objects.items() if v is fn)  # type: ignore[union-attr]
    try:
        yield
    finally:
        for fn in added:
            names.pop(fn, None)


def adopt(custom_objects: dict[str, Any] | None) -> None:
    """Gives the shipped copies in this process their names (a lambda is renamed: Keras saves a
    function named ``<lambda>`` as bytecode); registering them is ``serde.register_custom_objects``'."""
    for key, fn in (custom_objects or {}).items():
        if key.startswith(PACKAGE + ">") and is_lambda(fn):
            fn.__name__ = fn.__qualname__ = key.split(">", 1)[1]


def resolve_lambdas(config, custom_objects: dict[str, Any] | None) -> int:
    """Replaces, in a model's parsed config.json, every ``__lambda__`` entry whose saved form is that of
    a shipped lambda by a reference to it (by name, through the custom objects). Returns how many."""
    codes = (custom_objects or {}).get(LAMBDA_CODES) or {}
    by_form = {json.dumps(form): name for name, form in codes.items()}
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
            inner = item["config"]
            form = (
                inner.get("value")
                if "value" in inner
                else [inner.get("code"), inner.get("defaults"), inner.get("closure")]
            )
            name = by_form.get(json.dumps(form))
            if name is not None:
                item.clear()
                item.update({"module": "builtins", "class_name": "function", "config": name, "registered_name": name})
                replaced += 1
                continue
        stack.extend(item.values())
    return replaced
