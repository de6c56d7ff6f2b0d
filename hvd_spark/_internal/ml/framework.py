"""The seam between a fit's shared steps (``ml/steps.py``: checks, resume, data, ranks, restarts) and
the framework that trains the model: Keras 3 (:class:`KerasFramework`, here) or torch
(``ml/torch_framework.py``). The launcher, controller, data plan, reader, store and transform plumbing
are the same for both; what differs is how the model is checked against the columns, what names its
architecture for a resume, what the ranks receive and run, and the fitted model returned.

Nothing here loads Keras or torch at import; each method imports what it needs.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.ml.fit_params import FitParams


@dataclasses.dataclass(frozen=True)
class ModelCheck:
    """What a framework's :meth:`Framework.check_model` established: the params with their columns in
    the model's order, the model's input and output specs, and what ``transform`` predicts."""

    p: FitParams
    inputs: list
    outputs: list
    prediction: tuple[str, bool]  # (task, from_logits): model_info.prediction_task


class Framework:
    """One framework's part of a fit. ``name``: ``"keras"`` / ``"torch"``; ``suffix``: its model files'
    (checkpoints and final models in the store); ``description``: the fit's Spark job description."""

    name = ""
    suffix = ""
    description = ""

    def check_model(self, data, p: FitParams) -> ModelCheck:
        """Step 1b: the model against the columns of ``data`` (``fit_data.FitInput``; nothing written)."""
        raise NotImplementedError

    def shipped(self, p: FitParams, model, outputs) -> dict | None:
        """Step 1d: what every rank receives pickles; returns the custom objects (Keras) or None."""
        raise NotImplementedError

    def architecture(self, c) -> tuple[dict, Callable[[], str] | None]:
        """Step 2: the run's architecture record, and the fingerprint of runs recorded before it (or None)."""
        raise NotImplementedError

    def class_indices(self, c) -> list[bool | None]:
        """Per output: whether its labels are class indices (a sparse cross-entropy)."""
        raise NotImplementedError

    def compile_args(self, c, stats: dict | None = None) -> dict:
        """``RunConfig.training.compile``: how the ranks set the model up (``stats``: the data's column
        statistics, as ``data/stats.py`` checks them)."""
        raise NotImplementedError

    def model_bytes(self, c) -> bytes:
        """The user's model as the first attempt's ranks receive it."""
        raise NotImplementedError

    def rank_fn(self) -> Callable[..., Any]:
        """What each rank runs (a function of the ``RunConfig``)."""
        raise NotImplementedError

    def transformer(self, c, model_path: str, run_id: str, epoch_logs: list):
        """The fitted model: a Spark ML Model over the trained file."""
        raise NotImplementedError


class KerasFramework(Framework):
    """Keras 3 models: ``HorovodEstimator`` -> ``TFTransformer``."""

    name = "keras"
    suffix = ".keras"
    description = "HorovodEstimator.fit"

    def check_model(self, data, p: FitParams) -> ModelCheck:
        from hvd_spark._internal.ml import checks
        from hvd_spark._internal.ml.model_info import (
            is_compiled,
            model_specs,
            needs_build,
            prediction_task,
            with_ignored_classes,
        )

        model, dataset = p.model, data.frame
        if needs_build(model):  # a subclassed model never called: built as fit's first batch would build it
            checks._build_from_columns(model, dataset, p.feature_cols)
        inputs, outputs = model_specs(model)
        p = checks._match_model(dataset, p, inputs, outputs)
        inputs, outputs = checks._fed_dtypes(model, dataset, p.feature_cols, inputs, outputs)
        if not is_compiled(model) and (p.optimizer is None or p.loss is None):
            raise ValueError(
                "The model is not compiled, so optimizer and loss are required. Received: "
                f"optimizer={p.optimizer!r}, loss={p.loss!r}. Pass both, or compile the model."
            )
        if p.learning_rate is not None:
            checks._check_settable_learning_rate(p.optimizer if p.optimizer is not None else model.optimizer)
        loss = p.loss if p.loss is not None else getattr(model, "loss", None)
        outputs = with_ignored_classes(loss, outputs)  # SparseCategoricalCrossentropy(ignore_class=-1)
        return ModelCheck(p, inputs, outputs, prediction_task(p.task, loss, outputs))

    def shipped(self, p: FitParams, model, outputs) -> dict | None:
        from hvd_spark._internal.ml.checks import _check_shipped

        return _check_shipped(p, model, outputs)

    def architecture(self, c) -> tuple[dict, Callable[[], str] | None]:
        from hvd_spark._internal.ml.model_info import architecture, model_fingerprint

        p = c.p
        arch = architecture(c.model, p.optimizer, p.loss, {"features": p.feature_cols, "labels": p.label_cols})
        return arch, lambda: model_fingerprint(c.model)

    def class_indices(self, c) -> list[bool | None]:
        from hvd_spark._internal.ml.model_info import class_index_outputs

        loss = c.p.loss if c.p.loss is not None else getattr(c.model, "loss", None)
        return list(class_index_outputs(loss, c.outputs, c.p.label_shapes))

    def compile_args(self, c, stats: dict | None = None) -> dict:
        from hvd_spark._internal.common.serde import dumps_keras_obj
        from hvd_spark._internal.ml.model_info import compile_extras

        p = c.p
        comp = {
            k: (dumps_keras_obj(v, c.custom_objects) if v is not None else None)
            for k, v in (("optimizer", p.optimizer), ("loss", p.loss), ("metrics", p.metrics))
        }
        comp["loss_weights"] = p.loss_weights
        comp["learning_rate"] = p.learning_rate
        comp.update(compile_extras(c.model, p.optimizer))
        return comp

    def model_bytes(self, c) -> bytes:
        from hvd_spark._internal.common.serde import model_to_bytes

        return model_to_bytes(c.model, c.custom_objects)

    def rank_fn(self) -> Callable[..., Any]:
        from hvd_spark._internal.rank.train import train

        return train

    def transformer(self, c, model_path: str, run_id: str, epoch_logs: list):
        from hvd_spark._internal.ml.transformer import TFTransformer

        return TFTransformer(**transformer_params(c, model_path, run_id, epoch_logs))


def transformer_params(c, model_path: str, run_id: str, epoch_logs: list) -> dict:
    """The fitted model's params, the same for every framework: its file, the fit's columns and specs."""
    from hvd_spark._internal.common.contracts import history_from
    from hvd_spark._internal.common.specs import specs_to_dicts

    return dict(
        model_url=c.store.files.url(model_path),
        storage_options=c.store.storage_options,
        feature_cols=c.p.feature_cols,
        label_cols=c.p.label_cols,
        output_cols=c.p.output_cols,
        input_specs=specs_to_dicts(c.inputs),
        output_specs=specs_to_dicts(c.outputs),
        history=history_from(epoch_logs),
        run_id=run_id,
        custom_objects=c.custom_objects,
        task=c.prediction[0],
        from_logits=c.prediction[1],
        output_vectors=[i.kind == "vector" for i in c.l_infos],
        # bytes reach the model decoded: transform applies the fit's transformation_fn (other fits: rows only)
        transformation_fn=c.p.transformation_fn if any(i.kind == "binary" for i in c.f_infos) else None,
    )


KERAS = KerasFramework()
