"""A trained torch model (a ``.pt`` file the torch ranks wrote: ``rank/torch_train.py``) in a UDF worker
or on the driver: loaded once, predicting whole batches under ``torch.inference_mode``.

The batching, the checks of the rows and the Arrow / pandas plumbing are the Keras transformer's
(``batching.py``): a :class:`TorchPredictor` is a model with ``predict_on_batch``.
"""

from typing import Any

import numpy as np

from hvd_spark._internal.common.torch_files import read_torch_file


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
            # a read-only array is a view of the batch's Arrow buffers: the module gets its own copy to
            # edit in place if it does
            if isinstance(v, np.ndarray) and not v.flags.writeable:
                v = v.copy()
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
