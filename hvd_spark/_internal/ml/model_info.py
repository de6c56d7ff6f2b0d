"""What hvd_spark reads off a Keras model on the driver: input / output specs and a fingerprint."""

import hashlib
import json

from hvd_spark._internal.common.choices import TASKS
from hvd_spark._internal.common.specs import TensorSpec


def _struct_keys(struct, n: int) -> list[str] | None:
    """The dict keys of a model's inputs (outputs) in the order of ``model.inputs`` (Keras flattens a
    dict by sorted key), or None when the model was not built with a dict."""
    if not isinstance(struct, dict) or len(struct) != n:
        return None
    import keras

    return [str(k) for k in keras.tree.flatten({k: k for k in struct})]


def _specs(tensors, names, what: str, keys: list[str] | None = None) -> list[TensorSpec]:
    out = []
    for i, t in enumerate(tensors):
        shape = tuple(t.shape)
        if len(shape) < 1:
            raise ValueError(f"Model {what} {i} has shape {shape}; expected a batch axis first.")
        dtype = str(getattr(t, "dtype", "float32"))
        dtype = dtype.replace("<dtype: '", "").replace("'>", "")
        name = keys[i] if keys else (names[i] if i < len(names) else f"{what}_{i}")
        out.append(TensorSpec(name, tuple(shape[1:]), dtype, keys[i] if keys else None))
    return out


def model_specs(model, input_dtypes: list[str] | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's inputs and outputs (shape without the batch axis, dtype). ``input_dtypes``: the
    dtypes of a subclassed model's inputs (it has no symbolic inputs: see :func:`fed_by_columns`)."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model (Keras 3). Received: {type(model).__name__}.")
    if fed_by_columns(model):
        return _subclassed_specs(model, input_dtypes)
    inputs, outputs = list(model.inputs), list(model.outputs)
    in_names = list(
        getattr(model, "input_names", None) or [getattr(t, "name", f"input_{i}") for i, t in enumerate(inputs)]
    )
    out_names = list(getattr(model, "output_names", None) or [f"output_{i}" for i in range(len(outputs))])
    in_keys = _struct_keys(getattr(model, "_inputs_struct", None), len(inputs))
    out_keys = _struct_keys(getattr(model, "_outputs_struct", None), len(outputs))
    return _specs(inputs, in_names, "input", in_keys), _specs(outputs, out_names, "output", out_keys)


INPUT_DTYPES_ATTR = "_hvd_spark_input_dtypes"  # set by build_subclassed: a build config keeps no dtypes


def fed_by_columns(model) -> bool:
    """A model without symbolic inputs and outputs (subclassed): its inputs' dtypes are not its own (a
    build config keeps none), but those of the columns that feed it, as the first batch of ``fit``
    gives them (``checks._fed_dtypes``)."""
    try:
        return not (list(model.inputs) and list(model.outputs))
    except (AttributeError, ValueError):
        return True


def needs_build(model) -> bool:
    """A subclassed model that was never called: its input shapes are not known yet."""
    try:
        has_inputs = bool(model.inputs)
    except (AttributeError, ValueError):
        has_inputs = False
    return not has_inputs and not getattr(model, "built", False)


def build_subclassed(model, shapes: list[tuple], dtypes: list[str]) -> None:
    """Builds a subclassed model as its first batch in ``fit`` would: called once on symbolic inputs
    of these per-row shapes and dtypes (one input: the tensor; several: a list, in order)."""
    import keras

    tensors = [keras.KerasTensor((None, *shape), dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    model(tensors[0] if len(tensors) == 1 else tensors)
    setattr(model, INPUT_DTYPES_ATTR, list(dtypes))


def _subclassed_specs(model, input_dtypes: list[str] | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The specs of a built subclassed model (no symbolic inputs): the input shapes it was built with,
    of ``input_dtypes`` (default: those :func:`build_subclassed` recorded, else float32), and the outputs
    of a symbolic call on them."""
    import keras

    config = model.get_build_config() if getattr(model, "built", False) else None
    shapes = (config or {}).get("input_shape")
    if shapes is None:
        raise ValueError(
            "model must be built or buildable from its input shapes. Received a subclassed model "
            f"({type(model).__name__}) that was built without them (its build config holds no input_shape). "
            "Call it once on a batch of the features, or use a Functional model that starts with keras.Input."
        )
    several = isinstance(shapes, (list, tuple)) and bool(shapes) and all(isinstance(x, (list, tuple)) for x in shapes)
    shapes = [tuple(x) for x in shapes] if several else [tuple(shapes)]
    dtypes = list(input_dtypes or getattr(model, INPUT_DTYPES_ATTR, None) or ["float32"] * len(shapes))
    tensors = [keras.KerasTensor(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    out = model.compute_output_spec(tensors if several else tensors[0])
    keys = None
    if isinstance(out, dict):
        keys = [str(k) for k in keras.tree.flatten({k: k for k in out})]
        outs = [out[k] for k in keys]
    else:
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
    in_names = [f"input_{i}" for i in range(len(tensors))]
    out_names = keys or [f"output_{i}" for i in range(len(outs))]
    return _specs(tensors, in_names, "input"), _specs(outs, out_names, "output", keys)


def model_fingerprint(model) -> str:
    """The fingerprint of runs made before the full architecture was recorded (layer types and weight
    shapes only): still compared for them."""
    inputs, outputs = model_specs(model)
    layers = [[type(layer).__name__, [list(w.shape) for w in layer.weights]] for layer in model.layers]
    doc = {"layers": layers, "inputs": [list(s.shape) for s in inputs], "outputs": [list(s.shape) for s in outputs]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def architecture(model, optimizer=None, loss=None, columns: dict | None = None) -> dict:
    """What a run trains, as plain JSON: the model's whole configuration without its layer names
    (every layer's class and options: an activation, a dropout rate, a kernel size; the graph, with
    layers named by position), its weight shapes, the optimizer's class, the loss and the columns.
    Two models that differ here are different runs; their names, weights and learning rates do not count."""
    import keras

    from hvd_spark._internal.common import internals

    layers = internals.flatten_layers(model)
    names = {layer.name: f"#{i}" for i, layer in enumerate(layers)}
    names.setdefault(model.name, "#model")
    try:
        config = model.get_config()
    except NotImplementedError:  # a subclassed model without get_config: its layers' own configs
        config = {"layers": [_layer_config(layer) for layer in layers]}
    opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if isinstance(opt, str):
        opt = keras.optimizers.get(opt)
    return {
        "model_class": type(model).__name__,
        "config": _strip_names(config, names),
        "weights": [[names.get(layer.name, "?"), [list(w.shape) for w in layer.weights]] for layer in layers],
        "optimizer": None if opt is None else type(opt).__name__,
        "loss": _describe(loss if loss is not None else getattr(model, "loss", None)),
        "columns": columns or {},
    }


def architecture_fingerprint(arch: dict) -> str:
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _layer_config(layer) -> dict:
    try:
        config = layer.get_config()
    except NotImplementedError:
        config = {}
    return {"class_name": type(layer).__name__, "config": config}


def _strip_names(obj, names: dict[str, str]):
    """``obj`` (a Keras config) without the names of its layers and models (``name`` entries that hold
    one; a dtype policy's ``name`` stays), layer names elsewhere replaced by their positions."""
    if isinstance(obj, dict):
        return {
            k: _strip_names(v, names)
            for k, v in obj.items()
            if not (k == "name" and (not names or (isinstance(v, str) and v in names)))
        }
    if isinstance(obj, (list, tuple)):
        return [_strip_names(v, names) for v in obj]
    if isinstance(obj, str):
        return names.get(obj, obj)
    if isinstance(obj, (int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _describe(obj):
    """A loss (or several) as plain data: strings as they are, Keras objects as class and config."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_describe(v) for v in obj]
    if hasattr(obj, "get_config"):
        try:
            config = {k: v for k, v in obj.get_config().items() if k != "name"}
        except Exception:  # noqa: BLE001 - a config that cannot be built: the class alone
            config = {}
        return {"class": type(obj).__name__, "config": _strip_names(config, {})}
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def architecture_diff(old: dict, new: dict, limit: int = 3) -> list[str]:
    """Where two :func:`architecture` documents differ, as readable lines (at most ``limit``)."""
    out: list[str] = []

    def where(path: list) -> str:
        text = ""
        for part in path:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
        return text

    def walk(a, b, path: list, context: dict | None) -> None:
        if len(out) > limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            label = a.get("class_name") if isinstance(a.get("class_name"), str) else None
            keys = sorted(set(a) | set(b), key=str)
            if not path:  # what a person recognizes first: the model's kind, optimizer, loss, then its layers
                first = ["model_class", "optimizer", "loss", "columns", "config", "weights"]
                keys = [k for k in first if k in keys] + [k for k in keys if k not in first]
            for k in keys:
                if a.get(k, _MISSING) != b.get(k, _MISSING):
                    sub = path + ([f"{k} ({label})"] if label and k == "config" else [k])
                    walk(a.get(k, _MISSING), b.get(k, _MISSING), sub, a)
            return
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    walk(x, y, path + [i], context)
            return
        if isinstance(a, list) and isinstance(b, list):
            out.append(f"{where(path)}: {len(a)} entries -> {len(b)}")
            return
        out.append(f"{where(path)}: {_short(a)} -> {_short(b)}")

    walk(old, new, [], None)
    if len(out) > limit:
        out = out[:limit] + ["..."]
    return out


_MISSING = "<missing>"


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def compile_extras(model, optimizer=None) -> dict:
    """What the ranks need to compile ``model`` as it was compiled here, beyond its saved file: the
    model's dtype policy (a Functional model loaded elsewhere takes that process's global policy, and
    ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` only under ``"mixed_float16"``) and
    ``compile``'s ``auto_scale_loss``, which Keras does not save (read off the compiled optimizer; True
    when the optimizer is the ``optimizer`` Param's, as ``compile``'s default)."""
    import keras

    policy = keras.dtype_policies.get(getattr(model, "dtype_policy", None) or "float32").name
    auto = True
    if optimizer is None and is_compiled(model) and policy == "mixed_float16":
        auto = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    return {"dtype_policy": policy, "auto_scale_loss": auto}


def is_compiled(model) -> bool:
    return bool(getattr(model, "compiled", False)) and getattr(model, "optimizer", None) is not None


# Losses that make a model a classifier, and what kind: one probability per class, or one for class 1.
CLASSIFICATION_LOSSES = {
    "sparse_categorical_crossentropy": "multiclass",
    "categorical_crossentropy": "multiclass",
    "categorical_focal_crossentropy": "multiclass",
    "binary_crossentropy": "binary",
    "binary_focal_crossentropy": "binary",
}
SPARSE_LOSSES = ("sparse_categorical_crossentropy", "sparse_categorical_focal_crossentropy")


def class_index_outputs(loss, outputs: list[TensorSpec], label_shapes=None) -> list[bool]:
    """Per output: whether its labels are class indices: its loss is a sparse cross-entropy, or
    ``label_shapes`` (horovod.spark's Param) gives its label exactly the output's shape without its class
    axis, for an output of several axes (``(12,)`` for ``(12, 3)``): the user's own sparse loss opts in so.
    ``loss`` is one loss for every output, a list in the outputs' order or a dict by output name (or key)."""
    from hvd_spark._internal.common.specs import class_index_shape

    found = [loss_identity(one)[0] in SPARSE_LOSSES for one in losses_per_output(loss, outputs)]
    for i, (spec, shape) in enumerate(zip(outputs, label_shapes or ())):
        if len(spec.shape) > 1 and class_index_shape(spec) is not None and tuple(shape) == class_index_shape(spec):
            found[i] = True
    return found


def losses_per_output(loss, outputs: list[TensorSpec]) -> list:
    """Each output's loss (None where it has none): ``loss`` is one loss for every output, a list in the
    outputs' order or a dict by output name (or key)."""
    if isinstance(loss, dict):
        return [loss.get(s.key or "", loss.get(s.name)) for s in outputs]
    if isinstance(loss, (list, tuple)):
        return [loss[i] if i < len(loss) else None for i in range(len(outputs))]
    return [loss] * len(outputs)


def with_ignored_classes(loss, outputs: list[TensorSpec]) -> list[TensorSpec]:
    """The outputs, each with its sparse cross-entropy's ``ignore_class`` as a valid label
    (``TensorSpec.ignore_index``: the label of a padded step)."""
    import dataclasses

    out = []
    for spec, one in zip(outputs, losses_per_output(loss, outputs)):
        ignored = getattr(one, "ignore_class", None)
        out.append(spec if ignored is None else dataclasses.replace(spec, ignore_index=int(ignored)))
    return out


def loss_identity(loss) -> tuple[str | None, bool]:
    """The snake_case name of a Keras loss (a string, a ``keras.losses.Loss`` or a loss function) and
    whether it takes logits (``from_logits=True``). Several outputs: the first output's loss."""
    if isinstance(loss, (list, tuple)):
        loss = loss[0] if loss else None
    if isinstance(loss, dict):
        loss = next(iter(loss.values()), None)
    if loss is None:
        return None, False
    if isinstance(loss, str):
        return loss.lower(), False
    from_logits = False
    try:
        from_logits = bool(loss.get_config().get("from_logits", False))
    except Exception:  # noqa: BLE001 - not a Keras Loss object (a plain function)
        from_logits = bool(getattr(loss, "from_logits", False))
    if hasattr(loss, "get_config"):
        name = type(loss).__name__
    else:
        name = getattr(loss, "__name__", "") or type(loss).__name__
    import re

    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower(), from_logits


def prediction_task(task: str, loss, outputs: list[TensorSpec]) -> tuple[str, bool]:
    """What ``transform`` adds beside the raw output: ``("multiclass" | "binary", from_logits)`` for a
    classifier (Spark ML's prediction / probability / rawPrediction columns), ``("regression", False)``
    otherwise.

    ``task="auto"`` recognizes a classifier by its loss (:data:`CLASSIFICATION_LOSSES`) and the width of
    its single output (several units for multiclass, one for binary; a ``binary_crossentropy`` over
    several units is multi-label, not one class per row). ``"classification"`` also accepts other
    losses, from the output's width; ``"regression"`` never adds the columns.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}. Received: task={task!r}.")
    if task == "regression":
        return "regression", False
    name, logits = loss_identity(loss)
    # one row, one class: a per-step or per-pixel output ((12, 3), (H, W, C)) predicts many, its raw output only
    width = outputs[0].elements if len(outputs) == 1 and len(outputs[0].shape) <= 1 else None
    kind = CLASSIFICATION_LOSSES.get(name or "")
    if kind is None and task == "classification" and width is not None:
        kind = "binary" if width == 1 else "multiclass"
    fits = width is not None and ((kind == "binary" and width == 1) or (kind == "multiclass" and width >= 2))
    if not fits:
        if task == "classification":
            raise ValueError(
                "task='classification' needs a model with one output of one unit (binary: the probability or "
                "logit of class 1) or of one unit per class (multiclass). Received outputs "
                f"{[(s.name, list(s.shape)) for s in outputs]} with loss {name!r}."
            )
        return "regression", False
    return kind, logits  # type: ignore[return-value]
