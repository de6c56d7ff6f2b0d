"""What hvd_spark reads off a Keras model on the driver: input / output specs and a fingerprint."""

import hashlib
import json

from hvd_spark._internal.specs import TensorSpec


def _specs(tensors, names, what: str) -> list[TensorSpec]:
    out = []
    for i, t in enumerate(tensors):
        shape = tuple(t.shape)
        if len(shape) < 1:
            raise ValueError(f"Model {what} {i} has shape {shape}; expected a batch axis first.")
        dtype = str(getattr(t, "dtype", "float32"))
        dtype = dtype.replace("<dtype: '", "").replace("'>", "")
        out.append(TensorSpec(names[i] if i < len(names) else f"{what}_{i}", tuple(shape[1:]), dtype))
    return out


def model_specs(model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's inputs and outputs (shape without the batch axis, dtype)."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model (Keras 3). Received: {type(model).__name__}.")
    try:
        inputs, outputs = list(model.inputs), list(model.outputs)
    except (AttributeError, ValueError):
        inputs = outputs = []
    if not inputs or not outputs:
        raise ValueError(
            "model must be built with known input shapes: use a Functional or Sequential model that "
            "starts with keras.Input(shape=...). Received: a model without defined inputs "
            f"({type(model).__name__})."
        )
    in_names = list(
        getattr(model, "input_names", None) or [getattr(t, "name", f"input_{i}") for i, t in enumerate(inputs)]
    )
    out_names = list(getattr(model, "output_names", None) or [f"output_{i}" for i in range(len(outputs))])
    return _specs(inputs, in_names, "input"), _specs(outputs, out_names, "output")


def model_fingerprint(model) -> str:
    """Identifies a model's architecture (layer types and weight shapes), not its layer names or values."""
    inputs, outputs = model_specs(model)
    layers = [[type(layer).__name__, [list(w.shape) for w in layer.weights]] for layer in model.layers]
    doc = {"layers": layers, "inputs": [list(s.shape) for s in inputs], "outputs": [list(s.shape) for s in outputs]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def is_compiled(model) -> bool:
    return bool(getattr(model, "compiled", False)) and getattr(model, "optimizer", None) is not None
