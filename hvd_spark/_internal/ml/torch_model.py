"""``TorchModel``: predictions of a trained torch model through the same Arrow or pandas UDF as the
Keras ``TFTransformer`` (``transformer.py``), whose params, checks of the rows, Spark ML classifier
columns and persistence it shares; only the model differs (``torch_predict.py``)."""

from hvd_spark._internal.ml.transformer import TFTransformer


class TorchModel(TFTransformer):
    """Adds a trained torch model's predictions to a DataFrame (``hvd_spark.torch.TorchModel``).

    Returned by :meth:`hvd_spark.torch.TorchEstimator.fit`; also loadable with ``TorchModel.load(path)``.
    ``transform`` runs the module's forward pass (in eval mode, under ``torch.inference_mode``, on the
    CPU with ``spark.task.cpus`` threads) on whole Arrow batches, ``batch_size`` rows per call: one
    positional argument per feature column, in ``feature_cols``' order. Its output columns, null and NaN
    rules (``handleInvalid``) and Spark ML ``prediction`` / ``probability`` / ``rawPrediction`` columns for
    a classifier are those of :class:`hvd_spark.TFTransformer`.

    The model file is a pickle (``torch.save``, the module with its class by value when it was defined in
    ``__main__`` or a notebook): load only models of a store you trust.
    """

    def getModel(self):
        """The trained ``torch.nn.Module`` (loaded on the driver once, in eval mode)."""
        if self._keras_model is None:
            from hvd_spark._internal.infer.torch_predict import load_torch_model

            self._keras_model = load_torch_model(self.getModelUrl(), self.getStorageOptions())
        return self._keras_model

    def getOptimizer(self):
        """The optimizer as the fit left it (its state, step counts and learning rates) on the parameters
        of :meth:`getModel`'s module, as horovod.spark.torch's ``TorchModel.getOptimizer``: read from the
        run's checkpoint of the fit's last epoch (so it must still be in the store). None for a
        LightningModule, whose ``configure_optimizers`` makes its optimizers."""
        from hvd_spark._internal.common.torch_files import read_torch_file

        history = self.getHistory() or {}
        epochs = max((len(v) for v in history.values()), default=0)
        url = self.getModelUrl()
        if "/checkpoints/" in url:  # a fit that asked for no more epochs than the run had: that checkpoint
            ckpt = url
        elif epochs and "/models/" in url:
            ckpt = f"{url.rsplit('/models/', 1)[0]}/checkpoints/epoch-{epochs:04d}.pt"
        else:
            raise ValueError(f"No checkpoint to read the optimizer from: this model ({url}) has no epochs in a store.")
        try:
            saved = read_torch_file(ckpt, self.getStorageOptions())
        except FileNotFoundError:
            raise ValueError(
                f"The optimizer is read from the run's checkpoint of epoch {epochs}, {ckpt}, which is no longer in "
                "the store (removed by keep_checkpoints, Store.cleanup or by hand)."
            ) from None
        if saved.get("optimizer") is None:
            return None
        return rebind_optimizer(saved["optimizer"], saved["model"], self.getModel())

    def save_keras(self, path: str) -> str:
        raise TypeError("save_keras writes Keras models; this is a torch model: use save_torch(path).")

    def export_saved_model(self, path: str) -> str:
        raise TypeError("export_saved_model exports Keras models; this is a torch model: use save_torch(path).")

    def save_torch(self, path: str) -> str:
        """Writes the module with ``torch.save`` (``torch.load(path, weights_only=False)`` reads it back)."""
        import torch

        torch.save(self.getModel(), path)
        return path

    @classmethod
    def load(cls, path: str, safe_mode: bool | None = None) -> "TorchModel":
        """Loads a saved ``TorchModel`` (``safe_mode`` is Keras'; unused here)."""
        from hvd_spark._internal.ml.persistence import TransformerReader

        return TransformerReader(cls, safe_mode).load(path)


def rebind_optimizer(optimizer, saved_module, module):
    """A copy of ``optimizer`` (built on ``saved_module``'s parameters) on ``module``'s parameters of the
    same names, with its parameter groups and state."""
    by_id = {id(p): name for name, p in saved_module.named_parameters()}
    params = dict(module.named_parameters())
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params[by_id[id(p)]] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    fresh = type(optimizer)(groups, **optimizer.defaults)
    fresh.load_state_dict(optimizer.state_dict())
    return fresh


# Spark ML's saved metadata names the class by its module: the public name stays stable.
TorchModel.__module__ = "hvd_spark.torch"
