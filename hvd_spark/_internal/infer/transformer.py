"""``TFTransformer``: batch prediction with a trained Keras model through a pandas UDF.

The UDF is of the iterator form: each Python worker loads the model once (cached by model
URL and version) and predicts whole Arrow batches, cut into ``batch_size`` chunks.
"""

import contextlib
import functools
import operator
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
from pyspark.ml import Model
from pyspark.ml.param import TypeConverters
from pyspark.ml.param.shared import HasHandleInvalid, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark._internal.common.contracts import FitSummary
from hvd_spark._internal.common.specs import TensorSpec, column_label, stack_for_single_input, unpack
from hvd_spark._internal.common.topology import task_cpus
from hvd_spark._internal.driver.sessions import session_conf
from hvd_spark._internal.ml.params import ColumnParams, _param, with_accessors

_MODEL_CACHE: dict[str, Any] = {}
_MODEL_LOCK = threading.Lock()


GPU_BATCH_SIZE = 32768  # rows per model call on a GPU when batch_size was not set


def gpu_device(addresses: list[str] | None, cuda_visible: str | None) -> str | None:
    """TensorFlow's name for the first GPU Spark assigned to a task (``/GPU:<index>``), or None.

    TensorFlow numbers the GPUs it sees from 0: the physical id itself when ``CUDA_VISIBLE_DEVICES``
    is unset, else its position in that list (None when the assigned GPU is not in it)."""
    if not addresses:
        return None
    if cuda_visible is None:
        return f"/GPU:{int(addresses[0])}" if addresses[0].isdigit() else None
    visible = [v.strip() for v in cuda_visible.split(",") if v.strip()]
    return f"/GPU:{visible.index(addresses[0])}" if addresses[0] in visible else None


def _task_device() -> str | None:
    """The TensorFlow device of this UDF's task: its Spark-assigned GPU, if any."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    try:
        info = ctx.resources().get("gpu") if ctx is not None else None
    except Exception:  # a Spark without task resources
        info = None
    return gpu_device(list(info.addresses) if info else None, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _load_cached(
    key: str,
    model_url: str,
    storage_options: dict,
    custom_objects_bytes: bytes | None,
    num_threads: int,
    device: str | None = None,
):
    """The model at ``model_url``, loaded once per Python worker, model version (``key``) and device
    (a GPU Spark assigned to the task: the model's variables live there)."""
    key = f"{key}@{device}"
    with _MODEL_LOCK:
        model = _MODEL_CACHE.get(key)
        if model is not None:
            return model
        import cloudpickle

        from hvd_spark._internal.common.logs import tf_notices_dropped

        if device is not None:  # several Python workers share a GPU: each takes what it needs, not all
            os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        with tf_notices_dropped():
            import tensorflow  # noqa: F401  # its start-up notices are not the user's business

        from hvd_spark._internal.common.serde import load_model_file
        from hvd_spark._internal.rank.keras_hvd import set_threads

        set_threads(num_threads)
        custom_objects = cloudpickle.loads(custom_objects_bytes) if custom_objects_bytes else None
        with _on(device):
            model = load_model_file(model_url, custom_objects, compile=False, storage_options=storage_options)
        _MODEL_CACHE.clear()  # one model per worker at a time: older versions are dropped
        _MODEL_CACHE[key] = model
        return model


def _on(device: str | None):
    """``tf.device(device)``, or nothing. Soft placement: without that GPU, TensorFlow uses the CPU."""
    if device is None:
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.device(device)


def _predict_columns(
    model,
    cols: list,
    n: int,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    batch_size: int,
    names: list[str] | None = None,
) -> list[np.ndarray]:
    """Predicts ``n`` rows given as column values (numpy or pyarrow), ``batch_size`` rows per model call.

    Returns one float64 array of shape (n, values per row) per model output.
    """
    from hvd_spark._internal.rank.reader import to_model_inputs

    if n == 0:  # e.g. a batch whose rows all had a null feature (handleInvalid="keep")
        return [np.zeros((0, spec.elements or 1)) for spec in outputs]
    preds: list[list[np.ndarray]] = [[] for _ in outputs]
    for start in range(0, n, batch_size):
        x = to_model_inputs([c[start : start + batch_size] for c in cols], inputs, names)
        y = model.predict_on_batch(x)
        ys = unpack(y, outputs)
        for i, out in enumerate(ys):
            preds[i].append(np.asarray(out))
    return [
        (np.concatenate(parts) if parts else np.zeros((0, spec.elements or 0))).reshape(n, -1).astype(np.float64)
        for spec, parts in zip(outputs, preds)
    ]


def _null_error(col: str, nulls: int, n: int) -> ValueError:
    return ValueError(
        f"Feature column '{col}' has {nulls} null values in a batch of {n} rows; transform() needs "
        "a value in every row."
    )


def _null_elements_error(col: str, rows: int, n: int) -> ValueError:
    return ValueError(
        f"Feature column '{col}' has {rows} rows with null elements in a batch of {n} rows; transform() "
        "needs a value in every element (handleInvalid='keep' gives such rows null predictions, 'skip' "
        "leaves them out)."
    )


def _first_null(names: list[str], nulls: list[int], n: int, holed: list[int] | None = None) -> None:
    """Raises for the first column with a null value, or with rows that hold null elements (``holed``)."""
    for i, (name, count) in enumerate(zip(names, nulls)):
        if count:
            raise _null_error(name, count, n)
        if holed and holed[i]:
            raise _null_elements_error(name, holed[i], n)


def null_element_rows(arr) -> np.ndarray | None:
    """For a pyarrow list array: a bool mask of the rows that hold a null element (at any depth), or
    None when there is none (also for a non-list array). Vectorized: each null element's row comes
    from the rows' lengths (null rows hold no values)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        return None
    values = arr.flatten()  # the values of the rows, whatever the slice and the null rows
    deeper = null_element_rows(values)
    if values.null_count == 0 and deeper is None:
        return None
    bad = np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)
    if deeper is not None:
        bad |= deeper
    if not bad.any():
        return None
    # The row of each flattened value: flatten() leaves out what null rows hold, so count per row.
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    parents = np.repeat(np.arange(len(arr)), lengths)
    return np.bincount(parents[bad], minlength=len(arr)) > 0


def _output_arrays(arrays: list[np.ndarray], outputs: list[TensorSpec], valid: np.ndarray) -> list:
    """The predictions of the valid rows (``arrays``, row-major) as one pyarrow array per output over all
    rows: ``double`` for a single value, ``list<double>`` otherwise; the other rows null. A NaN the
    model gave stays NaN (not null): it is its output."""
    import pyarrow as pa

    n, m = len(valid), int(valid.sum())
    nulls = None if m == n else ~valid
    out = []
    for spec, arr in zip(outputs, arrays):
        if _is_scalar(spec):
            full = arr[:, 0]
            if m < n:  # scatter the predictions to their rows; the others stay empty and null
                full = np.zeros(n, dtype=np.float64)
                full[valid] = arr[:, 0]
            out.append(pa.array(full, type=pa.float64(), mask=nulls))
        else:
            sizes = np.where(valid, arr.shape[1], 0)
            offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
            flat = pa.array(arr.reshape(-1), type=pa.float64())
            out.append(pa.ListArray.from_arrays(offsets, flat, mask=None if nulls is None else pa.array(nulls)))
    return out


def predict_batches(
    model,
    frames: Iterator[pd.DataFrame],
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    feature_cols: list[str],
    output_cols: list[str],
    batch_size: int,
    keep_invalid: bool = False,
) -> Iterator:
    """Pure batching (pandas): predicts each batch in chunks and yields a Series (one output) or a DataFrame.

    Each frame holds the ``k`` feature columns, then one status column per feature, computed by Spark
    (:func:`feature_status`: 0 a value, 1 null, 2 an array with null elements), since pandas cannot
    tell a null from a NaN. A row with a null feature or null elements raises (naming the column), or
    with ``keep_invalid`` gets null outputs. A NaN value is a value: the model gets it.

    A single-value output is an Arrow-backed Series, so that a NaN the model gave stays NaN (pyspark
    turns a NaN of a numpy-backed Series into a null). A list output is an object Series of arrays
    (None for an invalid row): pyspark turns the NaNs inside into null elements, which
    ``TFTransformer._transform`` turns back into NaN (the model never outputs a null).
    """
    k = len(feature_cols)
    for frame in frames:
        n = len(frame)
        status = frame.iloc[:, k : 2 * k].to_numpy(dtype=np.int8)
        if not keep_invalid:
            _first_null(feature_cols, (status == 1).sum(axis=0).tolist(), n, (status == 2).sum(axis=0).tolist())
        valid = ~(status != 0).any(axis=1)
        rows = frame if valid.all() else frame[valid]
        columns = [rows.iloc[:, i].to_numpy() for i in range(k)]
        arrays = _predict_columns(model, columns, len(rows), inputs, outputs, batch_size, feature_cols)
        series = [
            pd.Series(pd.arrays.ArrowExtensionArray(a)) if _is_scalar(spec) else a.to_pandas()
            for spec, a in zip(outputs, _output_arrays(arrays, outputs, valid))
        ]
        yield series[0] if len(series) == 1 else pd.DataFrame(dict(zip(output_cols, series)))


def predict_arrow_batches(
    model,
    structs: Iterator,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    feature_cols: list[str],
    output_cols: list[str],
    batch_size: int,
    keep_invalid: bool = False,
) -> Iterator:
    """Pure batching (Arrow): each StructArray of feature columns -> an Arrow array of predictions.

    List features are reshaped from their flat values and list outputs built from flat values
    and offsets: no per-row Python on either side. A null feature, or an array with a null element,
    makes the row invalid, as in :func:`predict_batches`; a NaN value goes to the model.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    for struct in structs:
        if isinstance(struct, pa.ChunkedArray):
            struct = struct.combine_chunks()
        n = len(struct)
        cols = [struct.field(i) for i in range(struct.type.num_fields)]
        holes = [null_element_rows(c) for c in cols]
        if not keep_invalid:
            _first_null(
                feature_cols, [c.null_count for c in cols], n, [0 if h is None else int(h.sum()) for h in holes]
            )
        valid = np.ones(n, dtype=bool)
        for c, h in zip(cols, holes):
            if c.null_count:
                valid &= np.asarray(pc.is_valid(c).to_numpy(zero_copy_only=False), dtype=bool)
            if h is not None:
                valid &= ~h
        if not valid.all():
            keep = pa.array(valid)
            cols = [c.filter(keep) for c in cols]
        arrays = _predict_columns(model, cols, int(valid.sum()), inputs, outputs, batch_size, feature_cols)
        out = _output_arrays(arrays, outputs, valid)
        yield out[0] if len(out) == 1 else pa.StructArray.from_arrays(out, names=list(output_cols))


def _has_null_element(array_col):
    """Spark expression: whether an array column holds a null element (null for a null array)."""
    from pyspark.sql import functions as F

    return F.exists(array_col, lambda x: x.isNull())


def feature_status(info, expr):
    """Spark expression of a feature's status for :func:`predict_batches`: 0 a value (NaN included),
    1 null, 2 an array holding a null element."""
    from pyspark.sql import functions as F

    status = F.when(expr.isNull(), F.lit(1))
    if info.kind == "array":
        status = status.when(_has_null_element(expr), F.lit(2))
    return status.otherwise(F.lit(0)).cast("tinyint")


def arrow_udfs_available() -> bool:
    """Whether this pyspark has Arrow-native UDFs (``pyspark.sql.functions.arrow_udf``, Spark >= 4.1)."""
    try:
        from pyspark.sql.functions import arrow_udf  # noqa: F401

        return True
    except ImportError:
        return False


def _is_scalar(spec: TensorSpec) -> bool:
    return spec.elements == 1


@with_accessors(setters=("batch_size", "inference_udf"))
class TFTransformer(
    Model,
    ColumnParams,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasHandleInvalid,
    MLWritable,
    MLReadable,
):
    """Adds a trained Keras model's predictions to a DataFrame.

    Returned by :meth:`HorovodEstimator.fit`; also loadable with ``TFTransformer.load(path)``.
    Output columns are ``double`` for a single-value output and ``array<double>`` otherwise
    (higher-rank outputs are flattened, row-major).

    A row with a null feature, or with an array feature holding a null element, is invalid: refused by
    default, naming the column (``handleInvalid="error"``); ``"keep"`` gives it null predictions,
    ``"skip"`` leaves it out of the result. A NaN is a value, not a null: the model gets it, the same
    with the Arrow and the pandas UDF. A NaN the model outputs stays NaN in its output column, and a
    classifier's ``prediction``, ``probability`` and ``rawPrediction`` are null for that row: a NaN
    never becomes a class.

    ``storage_options`` (fsspec options to read ``model_url``, such as an S3 endpoint and keys) are
    not a Spark ML Param: never saved, never shown by ``explainParams()``. A loaded transformer reads
    its saved model file with none; see :meth:`setStorageOptions` to give credentials again.

    Example:
        >>> model = estimator.fit(train_df)            # doctest: +SKIP
        >>> model.transform(test_df).select("label", "label__output").show()   # doctest: +SKIP
        >>> model.getHistory()["val_accuracy"]           # doctest: +SKIP
    """

    model_url = _param("model_url", "URL of the trained model (.keras) on shared storage.", TypeConverters.toString)
    input_specs = _param("input_specs", "The model's inputs: shape (without batch axis) and dtype.")
    output_specs = _param("output_specs", "The model's outputs: shape (without batch axis) and dtype.")
    history = _param("history", "Training history: metric name -> value per epoch.")
    run_id = _param("run_id", "The training run that produced the model.", TypeConverters.toString)
    batch_size = _param("batch_size", "Rows per model call during transform.", TypeConverters.toInt)
    custom_objects = _param("custom_objects", "Custom Keras objects needed to load the model.")
    task = _param(
        "task",
        "What the model predicts: 'multiclass' or 'binary' (a classifier: transform adds Spark ML's "
        "prediction, probability and rawPrediction columns) or 'regression'. Set by fit.",
        TypeConverters.toString,
    )
    from_logits = _param(
        "from_logits", "Whether a classifier's output is logits (else probabilities).", TypeConverters.toBoolean
    )
    inference_udf = _param(
        "inference_udf",
        "How transform() calls the model: 'auto' (default: an Arrow UDF where "
        "pyspark has them, >= 4.1, else a pandas UDF), 'arrow' or 'pandas'.",
        TypeConverters.toString,
    )

    def __init__(
        self,
        *,
        model_url: str | None = None,
        feature_cols=None,
        label_cols=None,
        output_cols=None,
        input_specs=None,
        output_specs=None,
        history=None,
        run_id=None,
        batch_size: int = 4096,
        custom_objects=None,
        storage_options=None,
        inference_udf: str = "auto",
        task: str = "regression",
        from_logits: bool = False,
        predictionCol: str = "prediction",
        probabilityCol: str = "probability",
        rawPredictionCol: str = "rawPrediction",
        handleInvalid: str = "error",
    ):
        super().__init__()
        self._setDefault(
            task="regression",
            from_logits=False,
            batch_size=4096,
            history={},
            custom_objects=None,
            output_cols=None,
            label_cols=None,
            inference_udf="auto",
            handleInvalid="error",
        )
        kwargs = {
            k: v
            for k, v in dict(
                model_url=model_url,
                feature_cols=feature_cols,
                label_cols=label_cols,
                output_cols=output_cols,
                input_specs=input_specs,
                output_specs=output_specs,
                history=history,
                run_id=run_id,
                batch_size=batch_size,
                custom_objects=custom_objects,
                inference_udf=inference_udf,
                task=task,
                from_logits=from_logits,
                predictionCol=predictionCol,
                probabilityCol=probabilityCol,
                rawPredictionCol=rawPredictionCol,
                handleInvalid=handleInvalid,
            ).items()
            if v is not None
        }
        self._set(**kwargs)
        self._storage_options: dict = {}
        self.setStorageOptions(storage_options)
        self._keras_model = None
        self._fit_summary: FitSummary | None = None

    # --- storage options: a plain attribute, not a Param (credentials are never saved or shown) ---
    def setStorageOptions(self, value: dict | None) -> "TFTransformer":
        """Sets the fsspec options to read ``model_url`` (e.g. an S3 endpoint and keys) and returns ``self``.

        They are not a Spark ML Param: ``save`` never writes them and ``explainParams()`` never shows
        them. A loaded transformer reads its own saved model file with none; give them again here
        (or through the environment, e.g. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, or a
        profile) when it needs credentials."""
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"storage_options must be a dict. Received: {type(value).__name__}.")
        self._storage_options = dict(value or {})
        return self

    def getStorageOptions(self) -> dict:
        """The fsspec options to read ``model_url`` (a copy)."""
        return dict(self._storage_options)

    # --- Spark ML's classifier columns ---
    def setPredictionCol(self, value: str) -> "TFTransformer":
        """Sets the class-index column of a classifier (``""``: leave it out)."""
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value: str) -> "TFTransformer":
        """Sets the class-probability Vector column of a classifier (``""``: leave it out)."""
        return self._set(probabilityCol=value)

    def setRawPredictionCol(self, value: str) -> "TFTransformer":
        """Sets the raw-score Vector column of a classifier (``""``: leave it out)."""
        return self._set(rawPredictionCol=value)

    def setHandleInvalid(self, value: str) -> "TFTransformer":
        """What a row with a null feature (or an array feature with a null element) gets: ``"error"``
        (default), ``"keep"`` (null predictions) or ``"skip"`` (the row is left out)."""
        return self._set(handleInvalid=value)

    def _classifier_cols(self) -> dict[str, str]:
        """Spark ML's columns this transform adds (kind -> name): only for a single-output classifier."""
        if self.getOrDefault(self.task) not in ("multiclass", "binary") or len(self.getOutputCols()) != 1:
            return {}
        cols = {
            "prediction": self.getPredictionCol(),
            "probability": self.getProbabilityCol(),
            "rawPrediction": self.getRawPredictionCol(),
        }
        return {k: v for k, v in cols.items() if v}

    # --- getters ---
    def getHistory(self) -> dict[str, list[float]]:
        """Metric name -> list of per-epoch values (train and ``val_`` metrics), averaged over ranks."""
        return dict(self.getOrDefault(self.history) or {})

    def getModelUrl(self) -> str:
        return self.getOrDefault(self.model_url)

    def getRunId(self) -> str | None:
        return self.getOrDefault(self.run_id) if self.isDefined(self.run_id) else None

    def getFitSummary(self) -> FitSummary | None:
        """How the ``fit`` that returned this model went (run id, data key, steps per epoch,
        restarts, timings, each rank's weight digest and step counter); ``None`` for a loaded
        model or one returned from a finished run without training."""
        return self._fit_summary

    def _inputs(self) -> list[TensorSpec]:
        return [TensorSpec.from_dict(d) for d in self.getOrDefault(self.input_specs)]

    def _outputs(self) -> list[TensorSpec]:
        return [TensorSpec.from_dict(d) for d in self.getOrDefault(self.output_specs)]

    def getModel(self):
        """The trained model as a Keras model (loaded on the driver, once)."""
        if self._keras_model is None:
            import cloudpickle

            co = self.getOrDefault(self.custom_objects)
            self._keras_model = _load_uncached(
                self.getModelUrl(), self.getStorageOptions(), cloudpickle.dumps(co) if co else None
            )
        return self._keras_model

    def save_keras(self, path: str) -> str:
        """Writes the model as a ``.keras`` file (loadable with ``keras.models.load_model``)."""
        if not str(path).endswith(".keras"):
            raise ValueError(f"path must end with '.keras'. Received: {path!r}.")
        from hvd_spark._internal.common.serde import save_model_file

        save_model_file(self.getModel(), path)
        return path

    def export_saved_model(self, path: str) -> str:
        """Exports a TensorFlow SavedModel for serving (TF Serving, ``tf.saved_model.load``)."""
        self.getModel().export(path, format="tf_saved_model", verbose=False)
        return path

    # --- Spark ---
    def _output_type(self, contains_null: bool = False):
        """The UDF's return type (``contains_null``: list outputs may hold null elements, the pandas UDF's NaNs)."""
        from pyspark.sql import types as T

        outs = self._outputs()
        types = [T.DoubleType() if _is_scalar(s) else T.ArrayType(T.DoubleType(), contains_null) for s in outs]
        if len(outs) == 1:
            return types[0]
        return T.StructType([T.StructField(n, t, True) for n, t in zip(self.getOutputCols(), types)])

    def _check_columns(self, df) -> None:
        from hvd_spark._internal.data.materialize import column_info

        features = self.getFeatureCols()
        if not features:
            raise ValueError("TFTransformer needs feature_cols. Received: none.")
        known = self.isDefined(self.input_specs) and self.getOrDefault(self.input_specs)
        specs: list[TensorSpec | None] = [None] * len(features)
        if known:
            features = stack_for_single_input(features, self._inputs())
            specs = list(self._inputs())
        for c, spec in zip(features, specs):
            info = column_info(df, c, "feature")
            if spec is not None and info.kind == "scalar" and spec.elements not in (None, 1):
                raise ValueError(
                    f"Feature column '{c}' holds one value per row; model input '{spec.name}' takes "
                    f"{spec.elements} (shape {tuple(spec.shape)}). Use an array or Vector column (e.g. a "
                    "VectorAssembler of the scalar columns)."
                )
        clash = [c for c in self.getOutputCols() if c in df.columns]
        if clash:
            raise ValueError(
                f"Output columns {clash} already exist in the DataFrame. Set output_cols to new names "
                "(setOutputCols) or drop those columns first."
            )
        spark_cols = self._classifier_cols()
        taken = set(df.columns) | set(self.getOutputCols())
        for kind, name in spark_cols.items():
            if name in taken:
                raise ValueError(
                    f"{kind}Col {name!r} already exists in the DataFrame or is an output column. Set {kind}Col to a "
                    f"new name (set{kind[0].upper() + kind[1:]}Col), or to '' to leave that column out."
                )
            taken.add(name)
        if len(self.getOutputCols()) != len(self._outputs()):
            raise ValueError(
                f"output_cols must name one column per model output ({len(self._outputs())}). "
                f"Received: {self.getOutputCols()}."
            )

    def _use_arrow_udf(self) -> bool:
        choice = self.getOrDefault(self.inference_udf)
        if choice not in ("auto", "arrow", "pandas"):
            raise ValueError(f"inference_udf must be 'auto', 'arrow' or 'pandas'. Received: inference_udf={choice!r}.")
        if choice == "arrow" and not arrow_udfs_available():
            import pyspark

            raise ValueError(
                f"inference_udf='arrow' needs pyspark >= 4.1 (Arrow UDFs); this is pyspark "
                f"{pyspark.__version__}. Use inference_udf='auto' or 'pandas'."
            )
        return choice == "arrow" or (choice == "auto" and arrow_udfs_available())

    def _transform(self, dataset):
        from pyspark.sql import functions as F
        from pyspark.sql.functions import pandas_udf

        from hvd_spark._internal.data.materialize import col, column_info, feature_expr

        self._check_columns(dataset)
        self._use_arrow_udf()  # a bad inference_udf fails here, before any Spark job
        invalid = self.getHandleInvalid()
        if invalid not in ("error", "keep", "skip"):
            raise ValueError(f"handleInvalid must be 'error', 'keep' or 'skip'. Received: handleInvalid={invalid!r}.")
        keep = invalid == "keep"
        import cloudpickle

        inputs, outputs = self._inputs(), self._outputs()
        entries = stack_for_single_input(self.getFeatureCols(), inputs)
        feature_cols = [column_label(c) for c in entries]  # a stacked group by its name: [a, b, c]
        output_cols = self.getOutputCols()
        url, opts = self.getModelUrl(), self.getStorageOptions()
        co = self.getOrDefault(self.custom_objects)
        co_bytes = cloudpickle.dumps(co) if co else None
        batch_size = int(self.getOrDefault(self.batch_size))
        batch_set = self.isSet(self.batch_size)  # on a GPU, an unset batch_size grows to GPU_BATCH_SIZE
        num_threads = task_cpus(session_conf(dataset.sparkSession))
        names = [f"_f{i}" for i in range(len(feature_cols))]
        key = _model_version(url, opts)
        arrow = self._use_arrow_udf()

        if arrow:
            import pyarrow as pa
            from pyspark.sql.functions import arrow_udf

            def predict_arrow(structs: Iterator[pa.Array]) -> Iterator[pa.Array]:
                device = _task_device()
                model = _load_cached(key, url, opts, co_bytes, num_threads, device)
                rows = batch_size if device is None or batch_set else max(batch_size, GPU_BATCH_SIZE)
                with _on(device):
                    yield from predict_arrow_batches(
                        model, structs, inputs, outputs, feature_cols, output_cols, rows, keep
                    )

            # pyspark's stubs type returnType as a DataType literal; a StructType / ArrayType works.
            udf = arrow_udf(predict_arrow, returnType=self._output_type())  # type: ignore[call-overload]
        else:

            def predict(frames: Iterator[pd.DataFrame]) -> Iterator[pd.Series]:
                device = _task_device()
                model = _load_cached(key, url, opts, co_bytes, num_threads, device)
                rows = batch_size if device is None or batch_set else max(batch_size, GPU_BATCH_SIZE)
                with _on(device):
                    yield from predict_batches(model, frames, inputs, outputs, feature_cols, output_cols, rows, keep)

            udf = pandas_udf(predict, returnType=self._output_type(True))  # type: ignore[call-overload]
        infos = [column_info(dataset, c, "feature") for c in entries]
        exprs = [feature_expr(info) for info in infos]
        fields = [e.alias(n) for e, n in zip(exprs, names)]
        if not arrow:  # pandas turns a null into NaN: Spark says which rows are null (or hold null elements)
            fields += [feature_status(info, e).alias(f"_s{i}") for i, (info, e) in enumerate(zip(infos, exprs))]
        packed = F.struct(*fields)
        if invalid == "skip":
            present = [col(p).isNotNull() for info in infos for p in (info.parts or [info.name])]
            present += [~_has_null_element(col(info.name)) for info in infos if info.kind == "array" and not info.parts]
            dataset = dataset.where(functools.reduce(operator.and_, present))

        def nan_back(column, spec):  # the pandas UDF's list outputs hold their NaNs as null elements
            if arrow or _is_scalar(spec):
                return column
            return F.transform(column, lambda x: F.coalesce(x, F.lit(float("nan"))))

        if len(output_cols) == 1:
            result = dataset.withColumn(output_cols[0], nan_back(udf(packed), outputs[0]))
            return self._with_classifier_cols(result, output_cols[0])
        tmp = "__hvd_spark_pred"
        out = dataset.withColumn(tmp, udf(packed))
        fields = [nan_back(F.col(tmp).getField(c), spec).alias(c) for c, spec in zip(output_cols, outputs)]
        return out.select("*", *fields).drop(tmp)

    def _with_classifier_cols(self, df, out: str):
        """Adds a classifier's prediction (class index, double), probability and rawPrediction (Vectors)
        from its output column, with Spark SQL (no second pass through the model)."""
        cols = self._classifier_cols()
        if not cols:
            return df
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        from hvd_spark._internal.data.materialize import col

        o, logits = col(out), bool(self.getOrDefault(self.from_logits))
        if self.getOrDefault(self.task) == "multiclass":
            raw = o
            if logits:
                top = F.array_max(o)
                e = F.transform(o, lambda x: F.exp(x - top))
                total = F.aggregate(e, F.lit(0.0), lambda acc, x: acc + x)
                prob = F.transform(e, lambda x: x / total)
            else:
                prob = o
            # SQL text: F.array_position takes a Column as its value only from Spark 4.0 on.
            quoted = "`" + out.replace("`", "``") + "`"
            pred = F.expr(f"CAST(array_position({quoted}, array_max({quoted})) - 1 AS DOUBLE)")
            no_class = o.isNull() | F.exists(o, lambda x: F.isnan(x))  # array_max takes NaN as the largest
        else:  # binary: the output is the probability (or logit) of class 1
            p1 = 1.0 / (1.0 + F.exp(-o)) if logits else o
            raw = F.array(-o, o) if logits else F.array(1.0 - o, o)
            prob = F.array(1.0 - p1, p1)
            pred = (p1 > 0.5).cast("double")
            no_class = o.isNull() | F.isnan(o)  # Spark orders NaN above every number: NaN > 0.5
        exprs = {"prediction": pred, "probability": array_to_vector(prob), "rawPrediction": array_to_vector(raw)}
        # A row kept without a prediction (handleInvalid="keep"), or whose output holds a NaN, has nulls in
        # these columns too: a NaN never becomes a class.
        return df.select(
            "*", *[F.when(no_class, F.lit(None)).otherwise(exprs[kind]).alias(name) for kind, name in cols.items()]
        )

    # --- persistence (save / load come from MLWritable / MLReadable) ---
    @classmethod
    def read(cls):
        from hvd_spark._internal.ml.persistence import TransformerReader

        return TransformerReader(cls)

    def write(self):
        from hvd_spark._internal.ml.persistence import TransformerWriter

        return TransformerWriter(self)

    def copy(self, extra=None):
        that = super().copy(extra)
        that._keras_model = self._keras_model
        that._storage_options = dict(self._storage_options)
        return that


def _model_version(url: str, opts: dict) -> str:
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


def _load_uncached(url, opts, co_bytes):
    import cloudpickle

    from hvd_spark._internal.common.serde import load_model_file

    custom_objects = cloudpickle.loads(co_bytes) if co_bytes else None
    return load_model_file(url, custom_objects, compile=True, storage_options=opts)


# Spark ML's saved metadata names the class by its module: the public name stays stable.
TFTransformer.__module__ = "hvd_spark"
