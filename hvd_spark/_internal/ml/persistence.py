"""MLWritable / MLReadable for the estimator and the transformer.

Plain parameters go to Spark's standard metadata (``DefaultParamsWriter``); the model goes
beside it as ``model.keras``; Keras objects and Python callables (optimizer, loss, metrics,
callbacks, custom objects) as ``objects.pkl``. Paths are local paths or URLs that fsspec reads.
"""

import logging
import posixpath
from typing import Any

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

logger = logging.getLogger(__name__)

# Params that the classes do not have, skipped where older saved metadata holds them: the transformer's
# storage options (credentials) are a plain attribute, never saved.
_RETIRED_PARAMS = ("storage_options",)

_OBJECT_PARAMS = (
    "store",
    "model",
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "custom_objects",
    "callbacks",
    "backend_env",
)


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def _load_common(cls, path: str, sc):
    """A new instance with the saved uid and plain params, and the saved objects.pkl."""
    metadata = DefaultParamsReader.loadMetadata(path, sc)
    inst = cls()
    for section in ("paramMap", "defaultParamMap"):  # saved when it was a Param (its default, never a value)
        for name in _RETIRED_PARAMS:
            if not inst.hasParam(name):
                (metadata.get(section) or {}).pop(name, None)
    inst._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(inst, metadata)
    fs, root = _fs(path)
    with fs.open(posixpath.join(root, "objects.pkl"), "rb") as f:
        objects = cloudpickle.loads(f.read())
    return inst, objects, fs, root


def _spark(io) -> Any:
    """What Spark's metadata reader / writer gets: the session on Spark Connect (no SparkContext
    there; pyspark >= 4.0 accepts it), the SparkContext on a classic session (any pyspark)."""
    from hvd_spark._internal.driver.sessions import is_connect

    return io.sparkSession if is_connect(io.sparkSession) else io.sc


class _Writer(MLWriter):
    """Spark's MLWriter, with overwrite done through fsspec on Spark Connect (Spark's own goes
    through the JVM, which a Connect client does not have)."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        from hvd_spark._internal.driver.sessions import is_connect

        if not is_connect(self.sparkSession):
            super()._handleOverwrite(path)
            return
        fs, root = _fs(path)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _json_params(instance, skip):
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in skip}


def _config_without_secrets(store) -> dict:
    """The store's config as saved: no credentials among its storage options nor in its URL, and the
    names of what was left out (for the log line of the load)."""
    from hvd_spark._internal.common.secrets import split_secrets, url_without_credentials

    config = dict(store.to_config())
    config["storage_options"], removed = split_secrets(config.get("storage_options"))
    prefix = url_without_credentials(config["prefix"])
    if prefix != config["prefix"]:
        config["prefix"] = prefix
        removed.append("the user and password in the store's URL")
    config["removed_storage_options"] = removed
    return config


def _log_removed(removed: list[str], store) -> None:
    if removed:
        logger.info(
            "the store %r of this saved estimator was saved without its credentials (%s): give them in the "
            "environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), a profile, or with "
            "setStore(Store(prefix, storage_options=...))",
            store,
            ", ".join(removed),
        )


class EstimatorWriter(_Writer):
    def saveImpl(self, path: str) -> None:
        from hvd_spark._internal.common.serde import dumps_keras_obj, model_to_bytes
        from hvd_spark._internal.data.store import Store

        inst = self.instance
        DefaultParamsWriter.saveMetadata(inst, path, _spark(self), paramMap=_json_params(inst, _OBJECT_PARAMS))
        fs, root = _fs(path)
        objects = {}
        for name in _OBJECT_PARAMS:
            if not inst.isSet(name):
                continue
            value = inst.getOrDefault(name)
            if name == "model":
                with fs.open(posixpath.join(root, "model.keras"), "wb") as f:
                    f.write(model_to_bytes(value))
            elif name == "store":
                objects[name] = ("store", _config_without_secrets(Store.create(value)))
            elif name == "backend_env" and value is not None:
                from hvd_spark._internal.common.secrets import split_secrets

                kept, removed = split_secrets(value)  # credentials are never saved
                if removed:
                    logger.warning("backend_env: %s not saved (credentials); set them again after loading", removed)
                objects[name] = ("pickle", cloudpickle.dumps(kept))
            elif name in ("optimizer", "loss", "metrics"):
                objects[name] = ("keras_obj", dumps_keras_obj(value))
            else:
                objects[name] = ("pickle", cloudpickle.dumps(value))
        with fs.open(posixpath.join(root, "objects.pkl"), "wb") as f:
            f.write(cloudpickle.dumps(objects))


class EstimatorReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        from hvd_spark._internal.common.serde import loads_keras_obj, model_from_bytes
        from hvd_spark._internal.data.store import Store

        inst, objects, fs, root = _load_common(self.cls, path, _spark(self))
        custom = cloudpickle.loads(objects["custom_objects"][1]) if "custom_objects" in objects else None
        values = {}
        for name, (kind, data) in objects.items():
            if kind == "store":
                values[name] = Store.from_config(data)
                _log_removed(data.get("removed_storage_options") or [], values[name])
            elif kind == "keras_obj":
                values[name] = loads_keras_obj(data, custom)
            else:
                values[name] = cloudpickle.loads(data)
        model_file = posixpath.join(root, "model.keras")
        if fs.exists(model_file):
            with fs.open(model_file, "rb") as f:
                values["model"] = model_from_bytes(f.read(), custom_objects=custom, compile=True)
        inst._set(**values)
        return inst


class TransformerWriter(_Writer):
    def saveImpl(self, path: str) -> None:
        import fsspec

        inst = self.instance
        skip = ("custom_objects", "model_url")  # storage options (credentials) are not a Param: never saved
        DefaultParamsWriter.saveMetadata(inst, path, _spark(self), paramMap=_json_params(inst, skip))
        fs, root = _fs(path)
        src_fs, src = fsspec.core.url_to_fs(inst.getModelUrl(), **inst.getStorageOptions())
        with src_fs.open(src, "rb") as f_in, fs.open(posixpath.join(root, "model.keras"), "wb") as f_out:
            while True:
                chunk = f_in.read(8 << 20)
                if not chunk:
                    break
                f_out.write(chunk)
        with fs.open(posixpath.join(root, "objects.pkl"), "wb") as f:
            f.write(cloudpickle.dumps({"custom_objects": inst.getOrDefault("custom_objects")}))


class TransformerReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        inst, objects, fs, root = _load_common(self.cls, path, _spark(self))
        model_url = fs.unstrip_protocol(posixpath.join(root, "model.keras"))
        inst._set(model_url=model_url)  # read with no storage options: see TFTransformer.setStorageOptions
        if objects.get("custom_objects"):
            inst._set(custom_objects=objects["custom_objects"])
        return inst
