"""The model of each Python UDF worker: loaded once per worker, model file version and device.

Runs in Spark's Python UDF workers. A worker keeps one model at a time: a new version of the
file (another fit into the same path) replaces it."""

import os
import threading
from typing import Any

from hvd_spark._internal.infer.device import on_device
from hvd_spark._internal.infer.remote import RemoteModel

_MODEL_CACHE: dict[str, Any] = {}
_MODEL_LOCK = threading.Lock()


def load_cached(
    key: str,
    model_url: str,
    storage_options: dict,
    custom_objects_bytes: bytes | None,
    num_threads: int,
    device: str | None = None,
    warm_app: str | None = None,
):
    """The model at ``model_url``, loaded once per Python worker, model version (``key``) and device
    (a GPU Spark assigned to the task: the model's variables live there).

    ``warm_app`` (the application's id; CPU only): the model is loaded in a child of the host's warm
    server of that application, where TensorFlow is imported already (``remote.py``), and this
    worker gets a :class:`~hvd_spark._internal.infer.remote.RemoteModel`; without such a server, here."""
    key = f"{key}@{device}@{warm_app}"
    with _MODEL_LOCK:
        model = _MODEL_CACHE.get(key)
        if model is not None and not (isinstance(model, RemoteModel) and model.broken):
            return model

        def load():
            if warm_app is not None and device is None and not model_url.endswith(".pt"):  # torch: here
                from hvd_spark._internal.infer.remote import open_model

                remote = open_model(warm_app, model_url, storage_options, custom_objects_bytes, num_threads)
                if remote is not None:
                    remote.reload = here  # its process gone, this worker predicts
                    return remote
            return here()

        def here():
            return load_model(model_url, storage_options, custom_objects_bytes, num_threads, device)

        model = load()
        for old in _MODEL_CACHE.values():  # one model per worker at a time: older versions are dropped
            if isinstance(old, RemoteModel):
                old.close()  # its process ends
        _MODEL_CACHE.clear()
        _MODEL_CACHE[key] = model
        return model


def load_model(
    model_url: str, storage_options: dict, custom_objects_bytes: bytes | None, num_threads: int, device=None
):
    """Loads the model for predictions (not compiled), with TensorFlow's pools at ``num_threads``; a
    torch model's ``.pt`` file as a ``torch_predict.TorchPredictor`` with torch's threads at ``num_threads``."""
    if model_url.endswith(".pt"):
        from hvd_spark._internal.infer.torch_predict import TorchPredictor, load_torch_model

        return TorchPredictor(load_torch_model(model_url, storage_options), num_threads)
    import cloudpickle

    from hvd_spark._internal.common.logs import tf_notices_dropped

    if device is not None:  # several Python workers share a GPU: each takes what it needs, not all
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    with tf_notices_dropped():
        import tensorflow  # noqa: F401  # its start-up notices are not the user's business

    from hvd_spark._internal.common.serde import load_model_file
    from hvd_spark._internal.rank.threads import set_threads

    set_threads(num_threads)
    custom_objects = cloudpickle.loads(custom_objects_bytes) if custom_objects_bytes else None
    with on_device(device):
        return load_model_file(model_url, custom_objects, compile=False, storage_options=storage_options)


def model_version(url: str, opts: dict) -> str:
    """A cache key that changes when the model file is replaced."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(opts or {}))
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise ValueError(
            f"The model file {url} does not exist (was the store or the saved transformer moved?)."
        ) from None
    return f"{url}#{info.get('size')}#{info.get('mtime') or info.get('LastModified') or info.get('created')}"


def load_uncached(url, opts, co_bytes):
    import cloudpickle

    from hvd_spark._internal.common.serde import load_model_file

    custom_objects = cloudpickle.loads(co_bytes) if co_bytes else None
    return load_model_file(url, custom_objects, compile=True, storage_options=opts)
