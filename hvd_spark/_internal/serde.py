"""Turns Keras objects and Python callables into bytes that cross process boundaries and disk."""

import os
import tempfile
from typing import Any, Dict, Optional

import cloudpickle


def dumps_keras_obj(obj: Any) -> Any:
    """A picklable form of a loss / metric / optimizer: strings as they are, Keras objects as their
    config (Keras objects hold variables that do not pickle), anything else cloudpickled."""
    import keras

    if obj is None or isinstance(obj, (str, int, float, bool)):
        return ("plain", obj)
    if isinstance(obj, (list, tuple)):
        return ("list", [dumps_keras_obj(o) for o in obj])
    if isinstance(obj, dict):
        return ("dict", {k: dumps_keras_obj(v) for k, v in obj.items()})
    if isinstance(obj, (keras.optimizers.Optimizer, keras.losses.Loss, keras.metrics.Metric)):
        return ("keras", keras.saving.serialize_keras_object(obj))
    return ("pickle", cloudpickle.dumps(obj))


def loads_keras_obj(data: Any, custom_objects: Optional[Dict[str, Any]] = None) -> Any:
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
    return cloudpickle.loads(value)


def model_to_bytes(model) -> bytes:
    """The model as a ``.keras`` file's bytes (architecture, weights, compile config, optimizer)."""
    from hvd_spark._internal.keras_hvd import plain_class

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with plain_class(getattr(model, "optimizer", None)):
            model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: Optional[Dict[str, Any]] = None, compile: bool = True):
    import keras

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects, compile=compile)


def load_model_file(path: str, custom_objects: Optional[Dict[str, Any]] = None, compile: bool = True):
    import keras

    return keras.models.load_model(path, custom_objects=custom_objects, compile=compile)


