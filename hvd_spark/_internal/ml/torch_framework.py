"""torch models in a fit (``hvd_spark.torch.TorchEstimator``): the model checked against the columns,
its architecture record, what the ranks receive (``rank/torch_train.py`` runs them) and the
``TorchModel`` returned. The rest of the fit is the shared steps' (``ml/steps.py``, ``ml/framework.py``)."""

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common.specs import TensorSpec
from hvd_spark._internal.ml.fit_params import FitParams
from hvd_spark._internal.ml.framework import Framework, ModelCheck, transformer_params

logger = logging.getLogger(__name__)

_CLASS_INDEX_LOSSES = ("CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss")
_BINARY_LOSSES = {"BCEWithLogitsLoss": True, "binary_cross_entropy_with_logits": True, "BCELoss": False}


def _recorded(x) -> str:
    """A loss's (or an optimizer factory's) name in the run's architecture record, as runs recorded it."""
    return getattr(x, "__name__", None) or type(x).__name__


def _loss_name(loss) -> str:
    """A loss's name: its function's (a ``functools.partial`` unwrapped), else its class's, or that of the
    torch class-index loss it subclasses."""
    from hvd_spark._internal.rank.torch_losses import loss_name

    return loss_name(loss)


def is_optimizer(x) -> bool:
    """A torch optimizer object (an optimizer built on the model's parameters)."""
    return hasattr(x, "param_groups") and callable(getattr(x, "step", None)) and hasattr(x, "state_dict")


@dataclasses.dataclass(frozen=True)
class TorchFramework(Framework):
    """``TorchEstimator``'s framework-only params: ``input_shapes`` (horovod.spark's, each with its batch
    axis ``-1``), ``train_minibatch_fn`` and DDP's ``find_unused_parameters``."""

    input_shapes: Any = None
    train_minibatch_fn: Any = None
    find_unused_parameters: bool = False
    name = "torch"
    suffix = ".pt"
    description = "TorchEstimator.fit"

    # --- step 1 ---
    def check_model(self, data, p: FitParams) -> ModelCheck:
        import torch

        from hvd_spark._internal.ml import checks

        if not isinstance(p.model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: {type(p.model).__name__}.")
        if p.optimizer is None or p.loss is None:
            raise ValueError(
                f"optimizer and loss are required. Received: optimizer={p.optimizer!r}, loss={p.loss!r}. Pass an "
                "optimizer built on the model's parameters (or a function params -> optimizer) and a loss."
            )
        _check_optimizer(p.model, p.optimizer)
        if p.sample_weight_col:
            for loss in _as_list(p.loss):
                _check_per_row(loss)
        if isinstance(p.feature_cols, dict) or isinstance(p.label_cols, dict):
            raise ValueError("feature_cols and label_cols must be lists for a torch model (it has no input names).")
        inputs = self._input_specs(data, p)
        outputs = _output_specs(p.model, inputs, list(p.label_cols))
        outputs = [  # a class-index loss's ignore_index is a valid label (padded positions)
            dataclasses.replace(o, ignore_index=_ignore_index(loss))
            for o, loss in zip(outputs, _losses_for(p.loss, len(outputs)))
        ]
        p = checks._match_model(data.frame, p, inputs, outputs)
        return ModelCheck(p, inputs, outputs, _prediction(p.task, p.loss, outputs))

    def _input_specs(self, data, p: FitParams) -> list[TensorSpec]:
        """One input per feature column (or stacked group): ``input_shapes`` when given, else a scalar
        column ``()``, an array or Vector its length in the first row, a group ``(columns,)``."""
        from hvd_spark._internal.data import materialize as data_mod

        entries = list(p.feature_cols)
        infos = [data_mod.column_info(data.frame, c, "feature") for c in entries]
        for info in infos:
            if info.kind == "binary" and p.transformation_fn is None or info.element_type == "string":
                raise ValueError(
                    f"Feature column '{info.name}' holds {info.kind} values a torch model cannot take "
                    "(strings, or bytes without a transformation_fn decoding them)."
                )
        dtypes = ["int64" if i.is_integer else "float32" for i in infos]
        if self.input_shapes is not None:
            if len(self.input_shapes) != len(entries):
                raise ValueError(
                    f"input_shapes must give one shape per feature column ({len(entries)}). "
                    f"Received: {self.input_shapes!r}."
                )
            shapes = [tuple(int(d) for d in list(s)[1:]) for s in self.input_shapes]  # without the batch axis
        else:
            shapes = _column_shapes(data, infos)
        names = [i.name for i in infos]
        return [TensorSpec(n, s, d) for n, s, d in zip(names, shapes, dtypes)]

    def shipped(self, p: FitParams, model, outputs) -> dict | None:
        import cloudpickle

        if p.reader != "arrow":
            raise ValueError(f"A torch model is read with reader='arrow'. Received: reader={p.reader!r}.")
        for name, value in (
            ("model and optimizer", (model, p.optimizer)),
            ("loss", p.loss),
            ("metrics", p.metrics),
            ("train_minibatch_fn", self.train_minibatch_fn),
            ("callbacks", p.callbacks),
            ("transformation_fn", p.transformation_fn),
        ):
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise TypeError(
                    f"{name} must be picklable with cloudpickle: every rank receives a copy. Received: {value!r} "
                    f"({e}). A class defined in an importable module must be importable on the executors too "
                    "(or registered with cloudpickle.register_pickle_by_value)."
                ) from e
        return None

    # --- steps 2 to 4 ---
    def architecture(self, c) -> tuple[dict, Callable[[], str] | None]:
        p, model = c.p, c.model
        arch = {
            "framework": "torch",
            "model": type(model).__qualname__,
            "structure": repr(model),
            "weights": [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()],
            "optimizer": type(p.optimizer).__qualname__ if is_optimizer(p.optimizer) else _recorded(p.optimizer),
            "loss": [_recorded(x) for x in _as_list(p.loss)],
            "columns": {"features": list(p.feature_cols), "labels": list(p.label_cols)},
        }
        return arch, None

    def class_indices(self, c) -> list[bool | None]:
        losses = _losses_for(c.p.loss, len(c.outputs))
        return [_loss_name(x) in _CLASS_INDEX_LOSSES for x in losses]

    def compile_args(self, c, stats: dict | None = None) -> dict:
        import cloudpickle

        p = c.p
        weights = p.loss_weights
        if isinstance(weights, dict):
            weights = [weights.get(n, 1.0) for n in p.label_cols]
        parts = {
            "optimizer_factory": None if is_optimizer(p.optimizer) else p.optimizer,
            "losses": _losses_for(p.loss, len(c.outputs)),
            "loss_weights": weights,
            "metrics": list(p.metrics or []),
            "output_names": list(p.label_cols),
            "class_indices": self.class_indices(c),
            "train_minibatch_fn": self.train_minibatch_fn,
            "learning_rate": p.learning_rate,
            "find_unused_parameters": self.find_unused_parameters,
            "callbacks": list(p.callbacks or []),
            "may_ignore": self._may_ignore(c, stats),
        }
        return {"torch": cloudpickle.dumps(parts), "learning_rate": p.learning_rate}

    def _may_ignore(self, c, stats: dict | None) -> list[bool]:
        """Per output: whether a label may be its loss's ``ignore_index`` (which costs the ranks one allreduce a
        step: ``rank/torch_losses.py``). No, when the label column's statistics show its values all on one
        side of it and no ``transformation_fn`` may make others."""
        columns = (stats or {}).get("columns") or {}
        out = []
        for spec, info in zip(c.outputs, c.l_infos):  # the statistics' keys: the columns' (a group's) names
            s = columns.get(info.name) or {}
            low, high = s.get("min"), s.get("max")
            known = low is not None and high is not None and c.p.transformation_fn is None
            out.append(spec.ignore_index is not None and not (known and not low <= spec.ignore_index <= high))
        return out

    def model_bytes(self, c) -> bytes:
        import cloudpickle

        optimizer = c.p.optimizer if is_optimizer(c.p.optimizer) else None
        # one pickle: the optimizer's parameters stay the model's
        return cloudpickle.dumps({"model": c.model, "optimizer": optimizer})

    def rank_fn(self) -> Callable[..., Any]:
        from hvd_spark._internal.rank.torch_train import train

        return train

    def transformer(self, c, model_path: str, run_id: str, epoch_logs: list):
        from hvd_spark._internal.ml.torch_model import TorchModel

        return TorchModel(**transformer_params(c, model_path, run_id, epoch_logs))


def _ignore_index(loss) -> int | None:
    """The ``ignore_index`` of a class-index loss (torch's default -100 unless set), else None."""
    from hvd_spark._internal.rank.torch_losses import GlobalLoss

    return GlobalLoss(loss).ignore_index if _loss_name(loss) in _CLASS_INDEX_LOSSES else None


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _losses_for(loss, outputs: int) -> list:
    """One loss per output: a list as given, a dict by label name is refused earlier, one loss for all."""
    losses = _as_list(loss)
    if len(losses) == 1 and outputs > 1:
        losses = losses * outputs
    if len(losses) != outputs:
        raise ValueError(f"loss must be one loss, or one per output ({outputs}). Received {len(losses)} losses.")
    return losses


def _check_per_row(loss) -> None:
    """With sample weights each row's loss is weighted: a loss module is copied with ``reduction="none"``,
    a function must take a ``reduction`` argument (as ``torch.nn.functional``'s losses do)."""
    import inspect

    if hasattr(loss, "reduction"):
        return
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): tried on the ranks
    if not any(p.name == "reduction" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ValueError(
            f"sample_weight_col weights each row's loss, so the loss must give one per row: a torch.nn loss module "
            f"(copied with reduction='none') or a function taking reduction= (e.g. torch.nn.functional.mse_loss). "
            f"Received: loss={loss!r}."
        )


def _check_optimizer(model, optimizer) -> None:
    if not is_optimizer(optimizer):
        if callable(optimizer):
            return  # a factory: params -> optimizer, called on every rank
        raise TypeError(
            f"optimizer must be a torch optimizer built on the model's parameters, or a function params -> "
            f"optimizer. Received: {optimizer!r}."
        )
    own = {id(t) for t in model.parameters()}
    theirs = [t for g in optimizer.param_groups for t in g["params"]]
    if not theirs or any(id(t) not in own for t in theirs):
        raise ValueError(
            "optimizer must be built on this model's parameters (e.g. torch.optim.SGD(model.parameters(), lr=0.1)): "
            "some of its parameters are not the model's. Build it on the model you pass, or pass a function "
            "params -> optimizer."
        )


def _column_shapes(data, infos: list) -> list[tuple[int, ...]]:
    """Each feature's shape without the batch axis, from its column (the lengths from the first row)."""
    wide = [i.name for i in infos if i.kind not in ("scalar",) and not i.parts]
    row: dict | None = {}
    if wide:
        from hvd_spark._internal.data.jobs import spark_job

        with spark_job(f"reading the first row of the DataFrame (the lengths of {wide})"):
            row = data.first_row(wide)
        if not row:
            raise ValueError("The data passed to fit has no rows (the inputs' shapes come from its first row).")
    shapes: list[tuple[int, ...]] = []
    for info in infos:
        if info.parts:
            shapes.append((len(info.parts),))
        elif info.kind == "scalar":
            shapes.append(())
        else:
            shapes.append((_length(row[info.name]),))  # type: ignore[index]
    return shapes


def _length(value) -> int:
    """An array's or a Vector's length (a Vector read from Parquet by pyarrow: its struct)."""
    if isinstance(value, dict):  # pyspark.ml's VectorUDT as stored: {type, size, indices, values}
        return int(value["size"]) if value.get("size") is not None else len(value.get("values") or [])
    return int(value.size) if hasattr(value, "size") else len(value)


def _output_specs(model, inputs: list[TensorSpec], labels: list[str]) -> list[TensorSpec]:
    """The outputs' shapes, from one forward pass of two rows of zeros (eval mode, no gradients)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            xs = [torch.zeros((2, *s.dims), dtype=getattr(torch, s.dtype)) for s in inputs]
            out = model(*xs)
    except Exception as e:
        raise ValueError(
            f"The model could not run on inputs of shapes {[(None, *s.dims) for s in inputs]} (one per feature "
            f"column; set input_shapes if it takes others): {type(e).__name__}: {e}"
        ) from None
    finally:
        model.train(was_training)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(outs) != len(labels):
        raise ValueError(f"label_cols must name one column per model output ({len(outs)}). Received: {labels}.")
    return [  # torch's class axis is the first after the batch's ((N, C, d1, ...) for CrossEntropyLoss)
        TensorSpec(name, tuple(o.shape[1:]), str(o.dtype).replace("torch.", ""), class_axis=0)
        for name, o in zip(labels, outs)
    ]


def _prediction(task: str, loss, outputs: list[TensorSpec]) -> tuple[str, bool]:
    """What ``transform`` predicts: a classifier (multiclass or binary, logits or probabilities) or a regression."""
    if len(outputs) != 1 or task == "regression":
        return "regression", False
    if len(outputs[0].shape) > 1 and task != "classification":  # per step or pixel: the raw scores only
        return "regression", False
    name = _loss_name(_as_list(loss)[0])
    elements = outputs[0].elements or 1
    if name in _CLASS_INDEX_LOSSES and (task in ("auto", "classification")):
        return ("multiclass" if elements > 1 else "binary"), True
    if name in _BINARY_LOSSES and elements == 1 and task in ("auto", "classification"):
        return "binary", _BINARY_LOSSES[name]
    if task == "classification":
        return ("multiclass" if elements > 1 else "binary"), True
    return "regression", False
