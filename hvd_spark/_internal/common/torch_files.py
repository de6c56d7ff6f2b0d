"""hvd_spark's torch model files (``.pt``): what the torch ranks write (checkpoints, final models) and
``TorchModel`` reads. Loads torch only when a file is read."""

import os
import tempfile

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
