"""A trained torch model (a ``.pt`` file the torch ranks wrote: ``rank/torch_train.py``) in a UDF worker
or on the driver: loaded once, predicting whole batches under ``torch.inference_mode``.

The batching, the checks of the rows and the Arrow / pandas plumbing are the Keras transformer's
(``batching.py``): a :class:`TorchPredictor` is a model with ``predict_on_batch``.
"""

import os
import tempfile
from typing import Any

FORMAT = "hvd_spark.torch/1"  # the dict a .pt file of hvd_spark holds: {"format", "model", ...}


def read_torch_file(url: str, storage_options: dict | None = None) -> dict:
    """The dict saved in an hvd_spark ``.pt`` file (a local path or any fsspec URL).

    The file is a pickle (``torch.save`` with cloudpickle, so that classes defined in ``__main__`` or a
    notebook travel by value): load only files of a store you trust, as with any pickle."""
    import fsspec
    import torch

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    with tempfile.TemporaryDirectory() as d:
        local = path
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        if not ("file" in protocols or "local" in protocols):
            local = os.path.join(d, "model.pt")
            fs.get_file(path, local)
        obj = torch.load(local, map_location="cpu", weights_only=False)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{url} is not a model file hvd_spark's torch ranks wrote (no {FORMAT!r} format record).")
    return obj


def load_torch_model(url: str, storage_options: dict | None = None):
    """The ``torch.nn.Module`` of an hvd_spark ``.pt`` file, in eval mode."""
    module = read_torch_file(url, storage_options)["model"]
    module.eval()
    return module


class TorchPredictor:
    """``predict_on_batch`` over a module: numpy inputs (one array, a list: positional arguments, a dict:
    keyword arguments) in, numpy outputs out (a tensor, or a tuple / list / dict of them)."""

    def __init__(self, module, num_threads: int | None = None):
        import torch

        if num_threads:
            torch.set_num_threads(max(1, int(num_threads)))
        self.module = module
        self.module.eval()
        params = list(module.parameters())
        self.device = params[0].device if params else torch.device("cpu")

    def predict_on_batch(self, x: Any):
        import torch

        def tensor(v):
            return torch.as_tensor(v, device=self.device)

        with torch.inference_mode():
            if isinstance(x, dict):
                out = self.module(**{k: tensor(v) for k, v in x.items()})
            elif isinstance(x, (list, tuple)):
                out = self.module(*[tensor(v) for v in x])
            else:
                out = self.module(tensor(x))
        return _numpy(out)


def _numpy(out):
    if isinstance(out, dict):
        return {k: _numpy(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return [_numpy(v) for v in out]
    return out.detach().cpu().numpy()
