"""Spark ML Params shared by the estimator and the transformer, with strict type converters."""

from pyspark.ml.param import Param, Params, TypeConverters


def _identity(x):
    return x


def _opt_int(name):
    def conv(x):
        if x is None:
            return None
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an integer or None. Received: {x!r}.")
        return x

    return conv


def _opt_str(name):
    def conv(x):
        if x is None or isinstance(x, str):
            return x
        raise TypeError(f"{name} must be a string or None. Received: {x!r}.")

    return conv


def _opt_positive_float(name):
    def conv(x):
        if x is None:
            return None
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise TypeError(f"{name} must be a positive number or None. Received: {x!r}.")
        return float(x)

    return conv


def _str_list(name, groups: bool = False):
    """A converter for column-list params. With ``groups``, an entry may also be a list of column
    names (scalar columns stacked into one model input)."""

    def entry(c):
        if isinstance(c, str):
            return c
        if groups and isinstance(c, (list, tuple)) and c and all(isinstance(p, str) for p in c):
            return list(c)
        raise TypeError

    def conv(x):
        if x is None:
            return None
        if isinstance(x, str):
            return [x]
        try:
            if isinstance(x, (list, tuple)):
                return [entry(c) for c in x]
            if isinstance(x, dict) and all(isinstance(k, str) for k in x):
                return {k: entry(c) for k, c in x.items()}  # model tensor name (or dict key) -> column
        except TypeError:
            pass
        group = " (or a list of scalar columns to stack into one input)" if groups else ""
        raise TypeError(
            f"{name} must be a column name, a list of column names or a dict of model tensor name -> "
            f"column{group}. Received: {x!r}."
        )

    return conv


def _param(name, doc, conv=_identity):
    return Param(Params._dummy(), name, doc, typeConverter=conv)


def camel(name: str) -> str:
    """``batch_size`` -> ``BatchSize``: the suffix of a param's setter and getter."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def with_accessors(cls=None, *, setters: tuple[str, ...] | None = None):
    """Adds ``get<Name>`` and ``set<Name>`` for every Param that a class itself declares, unless it
    defines one by hand (horovod.spark's KerasEstimator spelling: ``setBatchSize``, ``getStore``, ...).
    Setters convert with the Param's type converter (errors name the param) and return ``self`` for
    chaining. ``setters`` limits the setters to those params (a fitted model's record is read-only)."""

    def add(cls):
        for name, param in list(vars(cls).items()):
            if not isinstance(param, Param):
                continue
            suffix = camel(name)
            if not hasattr(cls, f"get{suffix}"):
                setattr(cls, f"get{suffix}", _getter(name, param.doc))
            if (setters is None or name in setters) and not hasattr(cls, f"set{suffix}"):
                setattr(cls, f"set{suffix}", _setter(name, param.doc))
        return cls

    return add(cls) if cls is not None else add


def _getter(name: str, doc: str):
    def get(self):
        return self.getOrDefault(name)

    get.__name__ = f"get{camel(name)}"
    get.__doc__ = f"The value of ``{name}``: {doc}"
    return get


def _setter(name: str, doc: str):
    def set_(self, value):
        self._set(**{name: value})
        return self

    set_.__name__ = f"set{camel(name)}"
    set_.__doc__ = f"Sets ``{name}`` and returns ``self``: {doc}"
    return set_


@with_accessors
class ColumnParams(Params):
    feature_cols = _param(
        "feature_cols",
        "Feature column names, one per model input, in the model's input order (or a dict: input name "
        "-> column). Columns may be numeric, arrays of numbers, or Vectors; an entry may be a list of "
        "numeric columns, stacked in that order into one input.",
        _str_list("feature_cols", groups=True),
    )
    label_cols = _param(
        "label_cols", "Label column names, one per model output, in the model's output order.", _str_list("label_cols")
    )
    output_cols = _param(
        "output_cols",
        "Prediction column names, one per model output. Default: '<label>__output' for each label column.",
        _str_list("output_cols"),
    )

    def getFeatureCols(self):
        return self.getOrDefault(self.feature_cols)

    def getLabelCols(self):
        return self.getOrDefault(self.label_cols)

    def getOutputCols(self):
        out = self.getOrDefault(self.output_cols)
        if out:
            return out
        labels = self.getOrDefault(self.label_cols) or []
        return [f"{c}__output" for c in labels] or ["prediction"]


@with_accessors
class EstimatorParams(ColumnParams):
    num_proc = _param(
        "num_proc", "Number of Horovod processes (ranks). Default: the number of task slots.", _opt_int("num_proc")
    )
    store = _param(
        "store",
        "Where data, checkpoints, logs and models go: a path, a URL or a hvd_spark.Store. "
        "Must be reachable from every executor.",
    )
    model = _param("model", "The Keras 3 model to train (built: its input shapes known).")
    optimizer = _param("optimizer", "Keras optimizer (object or name). Default: the model's compiled optimizer.")
    loss = _param(
        "loss",
        "Loss (name, function, Loss object; a list or dict for several outputs). Default: the model's compiled loss.",
    )
    learning_rate = _param(
        "learning_rate",
        "The optimizer's learning rate for this fit, replacing the one it was built with (a number to search "
        "in a tuning grid without putting optimizer objects in it). Default: the optimizer's own.",
        _opt_positive_float("learning_rate"),
    )
    loss_weights = _param("loss_weights", "Weights of the losses of several outputs (list or dict).")
    metrics = _param("metrics", "Metrics, as for keras.Model.compile.")
    custom_objects = _param(
        "custom_objects", "Custom Keras objects (name -> class or function) needed to load the model."
    )
    sample_weight_col = _param(
        "sample_weight_col", "Column with a per-row sample weight.", _opt_str("sample_weight_col")
    )
    validation = _param(
        "validation",
        "Validation split: a fraction in [0, 1) of the rows (random, seeded by "
        "random_seed), or the name of a boolean / 0-1 column marking validation rows.",
    )
    callbacks = _param("callbacks", "Keras callbacks run on every rank (after metrics are averaged).")
    batch_size = _param(
        "batch_size", "Rows per batch on each rank (the global batch is batch_size * num_proc).", TypeConverters.toInt
    )
    val_batch_size = _param(
        "val_batch_size", "Rows per validation batch on each rank. Default: batch_size.", _opt_int("val_batch_size")
    )
    epochs = _param("epochs", "Total number of epochs. A resumed run trains until this epoch.", TypeConverters.toInt)
    train_steps_per_epoch = _param(
        "train_steps_per_epoch",
        "Steps per epoch on every rank. Default: ceil(train rows / (batch_size * num_proc)).",
        _opt_int("train_steps_per_epoch"),
    )
    validation_steps_per_epoch = _param(
        "validation_steps_per_epoch",
        "Validation steps per epoch on every rank. Default: ceil(val rows / (val_batch_size * num_proc)).",
        _opt_int("validation_steps_per_epoch"),
    )
    shuffle = _param(
        "shuffle", "Shuffle the training rows (row-group order and a seeded buffer).", TypeConverters.toBoolean
    )
    shuffle_buffer_size = _param(
        "shuffle_buffer_size", "Rows held in each rank's shuffle buffer.", TypeConverters.toInt
    )
    random_seed = _param(
        "random_seed", "Seed of the validation split, the shuffling and Keras' initializers.", TypeConverters.toInt
    )
    run_id = _param(
        "run_id",
        "Run name under <store>/runs/. An existing run resumes from its latest checkpoint. "
        "Default: a new name per fit.",
        _identity,
    )
    verbose = _param(
        "verbose",
        "0: quiet; 1: per-epoch progress on the driver's log; 2: also Keras' epoch lines from rank 0.",
        TypeConverters.toInt,
    )
    backend = _param(
        "backend", "Horovod controller: 'gloo' (default, CPU) or 'mpi' (one or several hosts).", TypeConverters.toString
    )
    task = _param(
        "task",
        "'auto' (default): a model with one output trained with a cross-entropy loss is a classifier; "
        "'classification' or 'regression' to say so. A classifier's transform adds Spark ML's "
        "prediction (class index), probability and rawPrediction (Vectors) columns.",
        TypeConverters.toString,
    )
    reader = _param(
        "reader",
        "How ranks read the materialized Parquet: 'arrow' (default; pyarrow, whole row groups, "
        "any pyarrow version) or 'petastorm' (Petastorm 0.13.1; needs pyarrow 12).",
        TypeConverters.toString,
    )
    reuse_data = _param(
        "reuse_data",
        "When a fit reuses data an earlier fit wrote to the store: 'auto' (default: only when the input is "
        "provably the same: its files with sizes and modification times, or data held in the query "
        "plan itself), 'always' (also when only the query plan matches: the input may have changed) or "
        "'never'.",
        TypeConverters.toString,
    )
    max_restarts = _param(
        "max_restarts",
        "Times a failed training job is started again from the latest checkpoint (default 0).",
        TypeConverters.toInt,
    )
    backward_passes_per_step = _param(
        "backward_passes_per_step",
        "Batches whose gradients each rank accumulates before one allreduce and update (Keras' "
        "gradient_accumulation_steps; like a batch this many times larger, with as many fewer "
        "allreduces). Default 1.",
        TypeConverters.toInt,
    )
    gradient_compression = _param(
        "gradient_compression",
        "'none' (default) or 'fp16': gradients travel as float16 in the allreduce (half the bytes).",
        TypeConverters.toString,
    )
    start_timeout = _param("start_timeout", "Seconds for all ranks to start (default 600).", _identity)
    use_gpu = _param(
        "use_gpu",
        "Each rank trains on exactly its barrier task's Spark-assigned GPUs (CUDA_VISIBLE_DEVICES, NCCL "
        "when Horovod has it). Default: True when spark.task.resource.gpu.amount is set.",
        _identity,
    )
    stall_timeout = _param(
        "stall_timeout",
        "Seconds without progress of any rank (a step, an epoch boundary) after which training is "
        "stopped as stalled, then restarted (max_restarts) or failed (default 300; 0: off).",
        _identity,
    )
    mlflow = _param(
        "mlflow",
        "MLflow tracking of the fit (extra 'mlflow'): 'auto' (default: when an MLflow run is active on "
        "the driver), 'on' (also starts a run when none is active) or 'off'. Logs the params, each "
        "epoch's rank-averaged metrics as they arrive, the run id and store paths, and the model.",
        _identity,
    )
