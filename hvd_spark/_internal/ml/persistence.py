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
    "class_weight",
    "backend_env",
    "transformation_fn",
    "checkpoint_callback",
)


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


# --- Spark ML metadata on filesystems Spark's Hadoop cannot reach ------------------------------------
#
# Spark ML writes every stage's metadata (``<path>/metadata``, one JSON line) through Hadoop's
# filesystems, so saving an estimator, a model or a Pipeline to ``s3://`` fails in a classic session
# without Hadoop's S3 jars, although everything else hvd_spark saves goes through fsspec. For such URLs
# only (a scheme Hadoop has no FileSystem class for), the metadata is written and read through fsspec in
# the layout Spark reads (``metadata/part-00000`` and ``_SUCCESS``); every other path is left to Spark.

_LOCAL_SCHEMES = ("", "file", "local", "hdfs", "viewfs")
_hadoop_has: dict[str, bool] = {}


def _through_fsspec(path: str) -> bool:
    """Whether ``path``'s scheme is one the classic session's Hadoop has no FileSystem for."""
    from urllib.parse import urlparse

    scheme = urlparse(str(path)).scheme.lower()
    if scheme in _LOCAL_SCHEMES or len(scheme) == 1:  # a Windows drive letter is no scheme
        return False
    if scheme not in _hadoop_has:
        from pyspark import SparkContext

        sc: Any = SparkContext._active_spark_context
        if sc is None:  # Spark Connect (no JVM here) or no session: Spark decides
            return False
        try:
            sc._jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, sc._jsc.hadoopConfiguration())
            _hadoop_has[scheme] = True
        except Exception as e:  # noqa: BLE001 - Py4J's error: only Hadoop's "No FileSystem for scheme" counts
            if "No FileSystem for scheme" not in str(e) and "UnsupportedFileSystemException" not in str(e):
                return False  # another failure: Spark decides, as without hvd_spark
            _hadoop_has[scheme] = False
    return not _hadoop_has[scheme]


def _files(fs, folder: str) -> list[str]:
    """The files below ``folder`` (object stores may keep empty folder markers, which are not files)."""
    fs.invalidate_cache()
    try:
        found = fs.find(folder)
    except FileNotFoundError:
        return []
    return sorted(p for p in found if p.rstrip("/") != folder.rstrip("/") and not p.endswith("/"))


def _save_metadata(original):
    def saveMetadata(instance, path, sc, extraMetadata=None, paramMap=None):
        if not _through_fsspec(path):
            return original(instance, path, sc, extraMetadata, paramMap)
        import pyspark
        from pyspark.sql import SparkSession

        if int(pyspark.__version__.split(".")[0]) >= 4 and not hasattr(sc, "createDataFrame"):
            sc = SparkSession.active()  # pyspark 4's _get_metadata_to_save takes the session
        text = DefaultParamsWriter._get_metadata_to_save(instance, sc, extraMetadata, paramMap)
        fs, root = _fs(path)
        folder = posixpath.join(root, "metadata")
        fs.invalidate_cache()  # object stores' listings are cached per filesystem instance
        if _files(fs, folder):
            raise OSError(f"{path}/metadata already exists: save with .overwrite() to replace it")
        with fs.open(posixpath.join(folder, "part-00000"), "wb") as f:
            f.write(text.encode() + b"\n")
        with fs.open(posixpath.join(folder, "_SUCCESS"), "wb"):
            pass

    return staticmethod(saveMetadata)


def _load_metadata(original):
    def loadMetadata(path, sc, expectedClassName=""):
        if not _through_fsspec(path):
            return original(path, sc, expectedClassName)
        fs, root = _fs(path)
        folder = posixpath.join(root, "metadata")
        parts = [p for p in _files(fs, folder) if not posixpath.basename(p).startswith(("_", "."))]
        if not parts:
            raise FileNotFoundError(f"no Spark ML metadata at {path}/metadata")
        with fs.open(parts[0], "rb") as f:
            text = f.read().decode().splitlines()[0]
        return DefaultParamsReader._parseMetaData(text, expectedClassName)

    return staticmethod(loadMetadata)


def _handle_overwrite(original):
    def _handleOverwrite(self, path):
        if not _through_fsspec(path):
            return original(self, path)
        fs, root = _fs(path)
        fs.invalidate_cache()
        if fs.exists(root):
            fs.rm(root, recursive=True)
            fs.invalidate_cache()

    return _handleOverwrite


def install() -> None:
    """Routes Spark ML's metadata for URLs Hadoop cannot reach through fsspec (once per process)."""
    if getattr(DefaultParamsWriter.saveMetadata, "_hvd_spark", False):
        return
    for cls, name, wrap in (
        (DefaultParamsWriter, "saveMetadata", _save_metadata),
        (DefaultParamsReader, "loadMetadata", _load_metadata),
        (MLWriter, "_handleOverwrite", _handle_overwrite),
    ):
        original = cls.__dict__[name]
        original = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = wrap(original)
        func = wrapped.__func__ if isinstance(wrapped, staticmethod) else wrapped
        setattr(func, "_hvd_spark", True)  # noqa: B010 - marks the installed wrapper
        setattr(cls, name, wrapped)


def _load_common(cls, path: str, sc, safe_mode: bool | None = None):
    """A new instance with the saved uid and plain params, and the saved objects.pkl (after
    :func:`check_safe_mode`)."""
    metadata = DefaultParamsReader.loadMetadata(path, sc)
    check_safe_mode(metadata, path, safe_mode)
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


LAMBDAS_KEY = "pythonLambdas"  # in a saved transformer's metadata: how many Python lambdas its model holds


def check_safe_mode(metadata: dict, path: str, safe_mode: bool | None) -> None:
    """Refuses, before anything is unpickled, to load a transformer whose model holds Python lambdas
    (``Lambda`` layers', a lambda loss: stored by value in objects.pkl) unless the user turned Keras'
    safe mode off: ``safe_mode=False``, or ``keras.config.enable_unsafe_deserialization()``."""
    import sys

    count = int(metadata.get(LAMBDAS_KEY) or 0)
    if not count or safe_mode is False:
        return
    if safe_mode is None and "keras" in sys.modules:
        from keras.src.saving import serialization_lib

        if serialization_lib.in_safe_mode() is False:  # keras.config.enable_unsafe_deserialization()
            return
    raise ValueError(
        f"The model saved at {path} holds {count} Python lambda(s) (a Lambda layer's function, a lambda loss), "
        "stored with it by value: loading them runs their code, which Keras' safe mode forbids. If you trust "
        f"{path}, load it with TFTransformer.load(path, safe_mode=False), or call "
        "keras.config.enable_unsafe_deserialization() first."
    )


def _spark(io) -> Any:
    """What Spark's metadata reader / writer gets: the session on Spark Connect (no SparkContext
    there; pyspark >= 4.0 accepts it), the SparkContext on a classic session (any pyspark)."""
    from hvd_spark._internal.common.sessions import is_connect

    return io.sparkSession if is_connect(io.sparkSession) else io.sc


class _Writer(MLWriter):
    """Spark's MLWriter, with overwrite done through fsspec on Spark Connect (Spark's own goes
    through the JVM, which a Connect client does not have)."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        from hvd_spark._internal.common.sessions import is_connect

        if not is_connect(self.sparkSession) and not _through_fsspec(path):
            super()._handleOverwrite(path)
            return
        fs, root = _fs(path)
        fs.invalidate_cache()
        if fs.exists(root):
            fs.rm(root, recursive=True)
            fs.invalidate_cache()


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
        bundled = getattr(inst, "_pickled_together", ())  # torch: the model and an optimizer built on it, one pickle
        skip = _OBJECT_PARAMS + tuple(bundled)
        DefaultParamsWriter.saveMetadata(inst, path, _spark(self), paramMap=_json_params(inst, skip))
        fs, root = _fs(path)
        objects = {}
        if bundled:
            together = {n: inst.getOrDefault(n) for n in bundled if inst.isSet(n)}
            objects["_together"] = ("together", cloudpickle.dumps(together))
        for name in _OBJECT_PARAMS:
            if not inst.isSet(name) or name in bundled:
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
            elif kind == "together":
                values.update(cloudpickle.loads(data))
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
        # storage options (credentials) are not a Param: never saved; functions go to objects.pkl
        skip = ("custom_objects", "model_url", "transformation_fn")
        from hvd_spark._internal.common.functions import LAMBDA_CODES

        lambdas = len((inst.getOrDefault("custom_objects") or {}).get(LAMBDA_CODES) or {})
        DefaultParamsWriter.saveMetadata(
            inst, path, _spark(self), extraMetadata={LAMBDAS_KEY: lambdas}, paramMap=_json_params(inst, skip)
        )
        fs, root = _fs(path)
        src_fs, src = fsspec.core.url_to_fs(inst.getModelUrl(), **inst.getStorageOptions())
        name = "model.pt" if str(inst.getModelUrl()).endswith(".pt") else "model.keras"  # torch's, or Keras'
        with src_fs.open(src, "rb") as f_in, fs.open(posixpath.join(root, name), "wb") as f_out:
            while True:
                chunk = f_in.read(8 << 20)
                if not chunk:
                    break
                f_out.write(chunk)
        with fs.open(posixpath.join(root, "objects.pkl"), "wb") as f:
            objects = {"custom_objects": inst.getOrDefault("custom_objects")}
            objects["transformation_fn"] = inst.getOrDefault("transformation_fn")
            f.write(cloudpickle.dumps(objects))


class TransformerReader(MLReader):
    def __init__(self, cls, safe_mode: bool | None = None):
        super().__init__()
        self.cls, self.safe_mode = cls, safe_mode

    def load(self, path: str):
        inst, objects, fs, root = _load_common(self.cls, path, _spark(self), self.safe_mode)
        name = "model.pt" if fs.exists(posixpath.join(root, "model.pt")) else "model.keras"
        model_url = fs.unstrip_protocol(posixpath.join(root, name))
        inst._set(model_url=model_url)  # read with no storage options: see TFTransformer.setStorageOptions
        if objects.get("custom_objects"):
            inst._set(custom_objects=objects["custom_objects"])
        if objects.get("transformation_fn") is not None:  # absent from models saved before it was kept
            inst._set(transformation_fn=objects["transformation_fn"])
        return inst
