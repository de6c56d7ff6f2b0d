"""``TFTransformer``: batch prediction with a trained Keras model through an Arrow or pandas UDF.

Its params and persistence live on the driver, beside the estimator's. ``_transform`` builds the UDF:
in each of Spark's Python UDF workers the model is loaded once (``infer/cache.py``) on the task's
device (``infer/device.py``) and whole Arrow batches go through ``infer/batching.py``, cut into
``batch_size`` chunks.
"""

import functools
import operator
from collections.abc import Iterator

import pandas as pd
from pyspark.ml import Model
from pyspark.ml.param import TypeConverters
from pyspark.ml.param.shared import HasHandleInvalid, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.choices import INFERENCE_UDFS, PREDICTION_TASKS
from hvd_spark._internal.common.contracts import FitSummary
from hvd_spark._internal.common.sessions import application_id, session_conf
from hvd_spark._internal.common.specs import TensorSpec, check_string_input, column_label, stack_for_single_input
from hvd_spark._internal.common.topology import task_cpus
from hvd_spark._internal.infer.batching import (
    column_transformation,
    is_scalar,
    predict_arrow_batches,
    predict_batches,
    short_errors,
)
from hvd_spark._internal.infer.cache import load_cached, load_uncached, model_version
from hvd_spark._internal.infer.device import GPU_BATCH_SIZE, on_device, task_device
from hvd_spark._internal.ml.driver_transform import DriverPredictor, driver_rows, free_name, predicted
from hvd_spark._internal.ml.expressions import (
    arrow_udfs_available,
    feature_status,
    has_nonfinite,
    has_null_element,
)
from hvd_spark._internal.ml.fit_params import boolean, choice, int_at_least
from hvd_spark._internal.ml.params import ColumnParams, _checked, _param, with_accessors


def _all_valid(infos, exprs):
    """``handleInvalid="skip"``'s filter: every feature present, without null elements, finite."""
    from pyspark.sql import functions as F

    from hvd_spark._internal.data.materialize import col

    present = [col(p).isNotNull() for info in infos for p in (info.parts or [info.name])]
    present += [~has_null_element(col(info.name)) for info in infos if info.kind == "array" and not info.parts]
    nonfinite = [has_nonfinite(info, e) for info, e in zip(infos, exprs)]
    present += [~F.coalesce(c, F.lit(False)) for c in nonfinite if c is not None]
    return functools.reduce(operator.and_, present)


@with_accessors(setters=("batch_size", "inference_udf", "transformation_fn"))
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
    (higher-rank outputs are flattened, row-major); a Spark ML Vector where the label column was one
    (``output_vectors``).

    A row with a null feature, with an array feature holding a null element, or with a NaN or an
    infinity in a feature (fit refuses them too) is invalid: refused by default, naming the column and
    the rows (``handleInvalid="error"``); ``"keep"`` gives it null predictions, ``"skip"`` leaves it
    out of the result; the same with the Arrow and the pandas UDF. A NaN the model outputs stays NaN in
    its output column, and a classifier's ``prediction``, ``probability`` and ``rawPrediction`` are
    null for that row: a NaN never becomes a class.

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
    batch_size = _param(
        "batch_size",
        "Rows per model call during transform (not the training batch: fit does not set it; on a GPU an "
        "unset batch_size grows to settings' GPU batch).",
        int_at_least("batch_size", 1),
    )
    custom_objects = _param("custom_objects", "Custom Keras objects needed to load the model.")
    task = _param(
        "task",
        "What the model predicts: 'multiclass' or 'binary' (a classifier: transform adds Spark ML's "
        "prediction, probability and rawPrediction columns) or 'regression'. Set by fit from the "
        "estimator's task ('auto' / 'classification' / 'regression') and the model's output: the "
        "estimator's param says how to train, this one what the trained model's output is.",
        choice("task", PREDICTION_TASKS, "'multiclass', 'binary' or 'regression'"),
    )
    from_logits = _param(
        "from_logits", "Whether a classifier's output is logits (else probabilities).", boolean("from_logits")
    )
    output_vectors = _param(
        "output_vectors",
        "Per output, whether its column is a Spark ML Vector (DenseVector): fit sets it where the label "
        "column is a Vector, so predictions take the label's type (as horovod.spark's do). Default: none.",
    )
    transformation_fn = _checked(
        "transformation_fn",
        "A function fn(pandas.DataFrame) -> pandas.DataFrame applied to each batch of the feature columns "
        "(the DataFrame's names) before the model: fit sets the estimator's where a feature column is binary "
        "(it decodes the bytes); None (default) otherwise.",
    )
    inference_udf = _param(
        "inference_udf",
        "How transform() calls the model: 'auto' (default: an Arrow UDF where "
        "pyspark has them, >= 4.1, else a pandas UDF), 'arrow' or 'pandas'.",
        choice("inference_udf", INFERENCE_UDFS, "'auto', 'arrow' or 'pandas'"),
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
        output_vectors=None,
        task: str = "regression",
        from_logits: bool = False,
        predictionCol: str = "prediction",
        probabilityCol: str = "probability",
        rawPredictionCol: str = "rawPrediction",
        handleInvalid: str = "error",
        transformation_fn=None,
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
            output_vectors=None,
            transformation_fn=None,
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
                output_vectors=output_vectors,
                task=task,
                from_logits=from_logits,
                predictionCol=predictionCol,
                probabilityCol=probabilityCol,
                rawPredictionCol=rawPredictionCol,
                handleInvalid=handleInvalid,
                transformation_fn=transformation_fn,
            ).items()
            if v is not None
        }
        self._set(**kwargs)
        self._storage_options: dict = {}
        self.setStorageOptions(storage_options)
        self._keras_model = None
        self._driver_model = DriverPredictor()  # a small local frame's predictions (driver_transform.py)
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
        """What a row with a null feature (or an array feature with a null element, or a NaN or an
        infinity in a feature) gets: ``"error"`` (default), ``"keep"`` (null predictions) or ``"skip"``
        (the row is left out)."""
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
        """Metric name -> list of per-epoch values (train and ``val_`` metrics), over all ranks' rows."""
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
            self._keras_model = load_uncached(
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
        types = [T.DoubleType() if is_scalar(s) else T.ArrayType(T.DoubleType(), contains_null) for s in outs]
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
            if info.kind == "binary" and self.getOrDefault(self.transformation_fn) is None:
                raise ValueError(
                    f"Feature column '{info.name}' holds bytes (binary): the model takes them decoded, by a "
                    "transformation_fn. Received: transformation_fn=None. Set one with setTransformationFn(fn), "
                    "fn(pandas.DataFrame) -> pandas.DataFrame decoding the column (fit sets the estimator's)."
                )
            if spec is not None:
                check_string_input(info.name, info.element_type, spec)
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

        from hvd_spark._internal.data.materialize import col, feature_expr

        self._check_columns(dataset)
        self._use_arrow_udf()  # a bad inference_udf fails here, before any Spark job
        invalid = self.getHandleInvalid()
        if invalid not in ("error", "keep", "skip"):
            raise ValueError(f"handleInvalid must be 'error', 'keep' or 'skip'. Received: handleInvalid={invalid!r}.")
        inputs, outputs = self._inputs(), self._outputs()
        entries = stack_for_single_input(self.getFeatureCols(), inputs)
        output_cols = self.getOutputCols()
        udf, infos, arrow, on_driver = self._prediction_udf(dataset, entries, inputs, outputs, keep=invalid == "keep")
        names = [f"_f{i}" for i in range(len(entries))]
        exprs = [feature_expr(info) for info in infos]
        fields = [e.alias(n) for e, n in zip(exprs, names)]
        if invalid == "skip":
            dataset = dataset.where(_all_valid(infos, exprs))
        # a small frame the driver holds is predicted by the driver, unless a UDF was asked for by name
        local = None
        if self.getOrDefault(self.inference_udf) == "auto" and driver_rows(dataset) is not None:
            tmp = free_name("__hvd_spark_pred", dataset.columns)
            local = predicted(dataset, F.struct(*fields), tmp, self._output_type(), on_driver)
        if local is not None:
            dataset, prediction, arrow = local, F.col(tmp), True
        else:
            if not arrow:  # pandas turns a null into NaN: Spark says which rows are null (or hold null elements)
                fields += [feature_status(info, e).alias(f"_s{i}") for i, (info, e) in enumerate(zip(infos, exprs))]
            prediction = udf(F.struct(*fields))

        def nan_back(column, spec):  # the pandas UDF's list outputs hold their NaNs as null elements
            if arrow or is_scalar(spec):
                return column
            return F.transform(column, lambda x: F.coalesce(x, F.lit(float("nan"))))

        vectors = list(self.getOrDefault(self.output_vectors) or []) + [False] * len(outputs)

        def typed(frame, i: int):  # a Vector label's prediction is a Vector (horovod.spark's output type)
            if not vectors[i]:
                return frame
            from pyspark.ml.functions import array_to_vector

            c = col(output_cols[i])
            vector = array_to_vector(F.array(c) if is_scalar(outputs[i]) else c)
            return frame.withColumn(output_cols[i], F.when(c.isNull(), F.lit(None)).otherwise(vector))

        if len(output_cols) == 1:
            result = dataset.withColumn(output_cols[0], nan_back(prediction, outputs[0]))
            result = result.drop(tmp) if local is not None else result
            return typed(self._with_classifier_cols(result, output_cols[0]), 0)
        tmp = free_name("__hvd_spark_pred", dataset.columns) if local is None else tmp
        out = dataset if local is not None else dataset.withColumn(tmp, prediction)
        fields = [nan_back(F.col(tmp).getField(c), spec).alias(c) for c, spec in zip(output_cols, outputs)]
        result = out.select("*", *fields).drop(tmp)
        for i in range(len(output_cols)):
            result = typed(result, i)
        return result

    def _prediction_udf(self, dataset, entries, inputs, outputs, *, keep: bool):
        """The UDF that predicts in Spark's Python workers (Arrow or pandas), with the feature columns'
        infos, whether it is an Arrow UDF, and the driver's predictions of an Arrow StructArray of the
        features (``driver_transform.py``). The UDF's closure holds plain values only: the model's URL and
        version, the pickled custom objects and ``transformation_fn``, the batch size, the threads."""
        import cloudpickle
        import pyarrow as pa
        from pyspark.sql.functions import pandas_udf

        from hvd_spark._internal.data.materialize import column_info

        feature_cols = [column_label(c) for c in entries]  # a stacked group by its name: [a, b, c]
        output_cols = self.getOutputCols()
        url, opts = self.getModelUrl(), self.getStorageOptions()
        co = self.getOrDefault(self.custom_objects)
        co_bytes = cloudpickle.dumps(co) if co else None
        batch_size = int(self.getOrDefault(self.batch_size))
        batch_set = self.isSet(self.batch_size)  # on a GPU, an unset batch_size grows to GPU_BATCH_SIZE
        conf = session_conf(dataset.sparkSession)
        num_threads = task_cpus(conf)
        # After a fit, the host's warm server has TensorFlow imported: the workers predict in its children.
        warm_app = application_id(dataset.sparkSession) if settings.WARM.get(conf=conf) else None
        key = model_version(url, opts)
        arrow = self._use_arrow_udf()
        infos = [column_info(dataset, c, "feature") for c in entries]
        fn = self.getOrDefault(self.transformation_fn)
        fn_bytes = cloudpickle.dumps(fn) if fn is not None else None  # by value, as the ranks get it

        def transformation():
            return column_transformation(cloudpickle.loads(fn_bytes), infos, inputs) if fn_bytes else None

        def on_driver(struct):
            model = self._driver_model.get(key, url, opts, co_bytes)
            arrays = list(
                predict_arrow_batches(
                    model,
                    iter([struct]),
                    inputs,
                    outputs,
                    feature_cols,
                    output_cols,
                    batch_size,
                    keep,
                    transformation(),
                )
            )
            return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)

        if arrow:
            from pyspark.sql.functions import arrow_udf

            def predict_arrow(structs: Iterator[pa.Array]) -> Iterator[pa.Array]:
                device = task_device()
                model = load_cached(key, url, opts, co_bytes, num_threads, device, warm_app)
                rows = batch_size if device is None or batch_set else max(batch_size, GPU_BATCH_SIZE)
                with on_device(device):
                    yield from short_errors(
                        predict_arrow_batches(
                            model, structs, inputs, outputs, feature_cols, output_cols, rows, keep, transformation()
                        )
                    )

            # pyspark's stubs type returnType as a DataType literal; a StructType / ArrayType works.
            udf = arrow_udf(predict_arrow, returnType=self._output_type())  # type: ignore[call-overload]
            return udf, infos, arrow, on_driver

        def predict(frames: Iterator[pd.DataFrame]) -> Iterator[pd.Series]:
            device = task_device()
            model = load_cached(key, url, opts, co_bytes, num_threads, device, warm_app)
            rows = batch_size if device is None or batch_set else max(batch_size, GPU_BATCH_SIZE)
            with on_device(device):
                yield from short_errors(
                    predict_batches(
                        model, frames, inputs, outputs, feature_cols, output_cols, rows, keep, transformation()
                    )
                )

        udf = pandas_udf(predict, returnType=self._output_type(True))  # type: ignore[call-overload]
        return udf, infos, arrow, on_driver

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

    @classmethod
    def load(cls, path: str, safe_mode: bool | None = None) -> "TFTransformer":
        """Loads a saved ``TFTransformer``. ``safe_mode`` as in ``keras.models.load_model``: a model
        holding Python lambdas (``Lambda`` layers', a lambda loss) loads only with ``safe_mode=False``
        or after ``keras.config.enable_unsafe_deserialization()``; None: Keras' global setting."""
        from hvd_spark._internal.ml.persistence import TransformerReader

        return TransformerReader(cls, safe_mode).load(path)

    def write(self):
        from hvd_spark._internal.ml.persistence import TransformerWriter

        return TransformerWriter(self)

    def copy(self, extra=None):
        that = super().copy(extra)
        that._keras_model = self._keras_model
        that._driver_model = DriverPredictor()  # its own: the copy may be given another model file
        that._storage_options = dict(self._storage_options)
        return that


# Spark ML's saved metadata names the class by its module: the public name stays stable.
TFTransformer.__module__ = "hvd_spark"
