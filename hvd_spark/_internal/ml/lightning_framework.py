"""Lightning modules in a fit (``hvd_spark.lightning.TorchEstimator``): torch's framework
(``torch_framework.py``: the inputs from the columns, the outputs from a forward pass, the ``.pt`` files,
``TorchModel``), with the module's own optimizers and loss (``configure_optimizers``, ``training_step``)
and Lightning's ``Trainer`` on the ranks (``rank/lightning_train.py``)."""

import dataclasses
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.ml.fit_params import FitParams
from hvd_spark._internal.ml.framework import ModelCheck
from hvd_spark._internal.ml.torch_framework import TorchFramework, _output_specs


@dataclasses.dataclass(frozen=True)
class LightningFramework(TorchFramework):
    """The Lightning estimator's own params: the ``Trainer``'s logger and ``log_every_n_steps`` (its
    callbacks are the estimator's ``callbacks``)."""

    logger: Any = None
    log_every_n_steps: int | None = None
    name = "lightning"
    description = "lightning.TorchEstimator.fit"

    def check_model(self, data, p: FitParams) -> ModelCheck:
        import lightning.pytorch as pl

        from hvd_spark._internal.ml import checks

        if not isinstance(p.model, pl.LightningModule):
            raise TypeError(f"model must be a lightning.pytorch.LightningModule. Received: {type(p.model).__name__}.")
        given = [n for n in ("optimizer", "loss", "metrics", "loss_weights") if getattr(p, n) is not None]
        if given:
            raise ValueError(
                f"{given} are not taken with a LightningModule: it configures its optimizers (configure_optimizers), "
                "computes its loss (training_step) and logs its metrics (self.log). Leave them unset."
            )
        unsupported = {
            "learning_rate": p.learning_rate,
            "gradient_compression": None if p.gradient_compression == "none" else p.gradient_compression,
            "checkpoint_every": p.checkpoint_every,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"{name} is not supported with a LightningModule yet (its Trainer runs the steps: set the "
                    f"learning rate in configure_optimizers; checkpoints come after every epoch). Received: "
                    f"{name}={value!r}."
                )
        if p.sample_weight_col:
            raise ValueError("sample_weight_col: a LightningModule reads the weight column from its batch itself.")
        if isinstance(p.feature_cols, dict) or isinstance(p.label_cols, dict):
            raise ValueError("feature_cols and label_cols must be lists for a LightningModule.")
        inputs = self._input_specs(data, p)
        outputs = _output_specs(p.model, inputs, list(p.label_cols))
        p = checks._match_model(data.frame, p, inputs, outputs)
        return ModelCheck(
            p, inputs, outputs, ("regression", False) if p.task != "classification" else _classes(outputs)
        )

    def class_indices(self, c) -> list[bool | None]:
        """None: the labels are the module's own business (its ``training_step`` gets them as stored), so
        their length is not checked against the output's (a padded sequence's tags for (classes, steps))."""
        return [None] * len(c.outputs)

    def compile_args(self, c, stats: dict | None = None) -> dict:
        import cloudpickle

        light = {
            "callbacks": list(c.p.callbacks or []),
            "logger": self.logger,
            "log_every_n_steps": self.log_every_n_steps,
        }
        parts = {"lightning": light, "output_names": list(c.p.label_cols), "class_indices": self.class_indices(c)}
        return {"torch": cloudpickle.dumps(parts), "learning_rate": None}

    def model_bytes(self, c) -> bytes:
        import cloudpickle

        return cloudpickle.dumps({"model": c.model, "optimizer": None})

    def architecture(self, c) -> tuple[dict, Callable[[], str] | None]:
        arch, _ = super().architecture(c)
        arch.update(framework="lightning", optimizer=None, loss=None)
        return arch, None

    def rank_fn(self) -> Callable[..., Any]:
        from hvd_spark._internal.rank.lightning_train import train

        return train


def _classes(outputs) -> tuple[str, bool]:
    """task="classification": a module's output is logits (or log-probabilities: the same classes)."""
    elements = outputs[0].elements or 1 if len(outputs) == 1 else 1
    return ("multiclass" if elements > 1 else "binary"), True
