"""Spark ML Params shared by the estimator and the transformer, with strict type converters.

Each estimator Param converts with :data:`converters.CONVERTERS` (the checks of the typed record
``FitParams`` that ``fit`` builds), so a wrong value fails when it is set, naming the param. The
Params' defaults are fit_params.py's ``DEFAULTS``, grouped as the docs list them."""

from pyspark.ml.param import Param, Params

from hvd_spark._internal.ml.converters import CONVERTERS


def _identity(x):
    return x


def _param(name, doc, conv=_identity):
    return Param(Params._dummy(), name, doc, typeConverter=conv)


def _checked(name, doc):
    """A Param converted by the estimator's converter of that name."""
    return _param(name, doc, CONVERTERS[name])


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
        CONVERTERS["feature_cols"],
    )
    label_cols = _param(
        "label_cols",
        "Label column names, one per model output, in the model's output order; an entry may be a list of "
        "numeric columns, stacked in that order into one output's label.",
        CONVERTERS["label_cols"],
    )
    output_cols = _param(
        "output_cols",
        "Prediction column names, one per model output. Default: '<label>__output' for each label column "
        "('a_b_c__output' for the stacked columns ['a', 'b', 'c']).",
        CONVERTERS["output_cols"],
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
        return [f"{c if isinstance(c, str) else '_'.join(c)}__output" for c in labels] or ["prediction"]


@with_accessors
class EstimatorParams(ColumnParams):
    num_proc = _checked(
        "num_proc",
        "Number of Horovod processes (ranks). Default: one per host (executor, or the machine of a local "
        "master) with threads on all its cores; one per task slot with HVD_SPARK_RANK_LAYOUT=slot.",
    )
    store = _checked(
        "store",
        "Where data, checkpoints, logs and models go: a path, a URL or a hvd_spark.Store. "
        "Must be reachable from every executor.",
    )
    model = _checked("model", "The Keras 3 model to train (built: its input shapes known).")
    optimizer = _checked("optimizer", "Keras optimizer (object or name). Default: the model's compiled optimizer.")
    loss = _checked(
        "loss",
        "Loss (name, function, Loss object; a list or dict for several outputs). Default: the model's compiled loss.",
    )
    learning_rate = _checked(
        "learning_rate",
        "The optimizer's learning rate for this fit, replacing the one it was built with (a number to search "
        "in a tuning grid without putting optimizer objects in it). Default: the optimizer's own.",
    )
    loss_weights = _checked("loss_weights", "Weights of the losses of several outputs (list or dict).")
    metrics = _checked("metrics", "Metrics, as for keras.Model.compile.")
    custom_objects = _checked(
        "custom_objects", "Custom Keras objects (name -> class or function) needed to load the model."
    )
    sample_weight_col = _checked("sample_weight_col", "Column with a per-row sample weight.")
    validation = _checked(
        "validation",
        "Validation split: a fraction in [0, 1) of the rows (random, seeded by "
        "random_seed), or the name of a boolean / 0-1 column marking validation rows.",
    )
    callbacks = _checked(
        "callbacks",
        "Keras callbacks run on every rank after metrics are averaged (TensorBoard, CSVLogger and ModelCheckpoint "
        "on rank 0 only, relative paths under the run's outputs/ in the store).",
    )
    class_weight = _checked(
        "class_weight",
        "As for keras.Model.fit: {class index: weight}, weighting each training row's loss by its class "
        "(a single-output model; not with sample_weight_col).",
    )
    validation_freq = _checked(
        "validation_freq",
        "As for keras.Model.fit: validate every N epochs (an int), or after the listed epochs (1-based). Default 1.",
    )
    batch_size = _checked(
        "batch_size",
        "Rows per training batch on each rank (the global batch is batch_size * num_proc). Not the fitted "
        "TFTransformer's batch_size (rows per model call in transform), which fit leaves at its default.",
    )
    val_batch_size = _checked("val_batch_size", "Rows per validation batch on each rank. Default: batch_size.")
    epochs = _checked("epochs", "Total number of epochs. A resumed run trains until this epoch.")
    train_steps_per_epoch = _checked(
        "train_steps_per_epoch",
        "Steps per epoch on every rank. Default: ceil(train rows / (batch_size * num_proc)).",
    )
    validation_steps_per_epoch = _checked(
        "validation_steps_per_epoch",
        "Validation steps per epoch on every rank. Default: ceil(val rows / (val_batch_size * num_proc)).",
    )
    shuffle = _checked("shuffle", "Shuffle the training rows (row-group order and a seeded buffer).")
    shuffle_buffer_size = _checked("shuffle_buffer_size", "Rows held in each rank's shuffle buffer.")
    random_seed = _checked("random_seed", "Seed of the validation split, the shuffling and Keras' initializers.")
    run_id = _checked(
        "run_id",
        "Run name under <store>/runs/. An existing run resumes from its latest checkpoint. "
        "Default: a new name per fit.",
    )
    verbose = _checked(
        "verbose",
        "0: quiet; 1: per-epoch progress on the driver's log; 2: also Keras' epoch lines from rank 0.",
    )
    backend = _checked(
        "backend",
        "Horovod controller: 'gloo' (default, CPU) or 'mpi' (one or several hosts). The constructor, setParams "
        "and setBackend also take an object with run(fn, args, kwargs, env) and num_processes() (horovod.spark's "
        "Backend shape) that runs the ranks instead; it is kept beside the Params and never saved.",
    )
    task = _checked(
        "task",
        "'auto' (default): a model with one output trained with a cross-entropy loss is a classifier; "
        "'classification' or 'regression' to say so. A classifier's transform adds Spark ML's "
        "prediction (class index), probability and rawPrediction (Vectors) columns. The fitted "
        "TFTransformer's own task param holds what fit decided: 'multiclass', 'binary' or 'regression'.",
    )
    reader = _checked(
        "reader",
        "How ranks read the materialized Parquet: 'arrow' (default; pyarrow, whole row groups, "
        "any pyarrow version) or 'petastorm' (Petastorm 0.13.1; needs pyarrow 12).",
    )
    reuse_data = _checked(
        "reuse_data",
        "When a fit reuses data an earlier fit wrote to the store: 'auto' (default: only when the input is "
        "provably the same: its files with sizes and modification times, or data held in the query "
        "plan itself), 'always' (also when only the query plan matches: the input may have changed) or "
        "'never'.",
    )
    materialize = _checked(
        "materialize",
        "'auto' (default): read a DataFrame that is a plain scan of Parquet files (a path or a catalog "
        "table; columns selected, renamed or cast between numbers) in place, copy anything else to the "
        "store; 'always': copy; 'never': read in place or refuse before any work.",
    )
    max_restarts = _checked(
        "max_restarts",
        "Times a failed training job is started again from the latest checkpoint (default 0).",
    )
    min_num_proc = _checked(
        "min_num_proc",
        "Elastic training: the fewest ranks it goes on with. It starts once this many task slots exist, "
        "continues on the slots left after a lost rank, executor or host (from the latest commit), and "
        "fails after elastic_timeout with fewer. Needs max_restarts >= 1. Default: not elastic.",
    )
    max_num_proc = _checked(
        "max_num_proc",
        "Elastic training: the most ranks; when slots come back, training grows to up to this many at "
        "the next epoch end. Default: the application's task slots (when min_num_proc is set).",
    )
    elastic_timeout = _checked(
        "elastic_timeout",
        "Elastic training: seconds with fewer than min_num_proc task slots before fit fails with "
        "NotEnoughSlotsError (default 600).",
    )
    checkpoint_every = _checked(
        "checkpoint_every",
        "Commits inside an epoch: every N steps (an integer), or every period ('90s', '10min', '1h'); each "
        "also records which rows every rank has read, so that a restart or resize continues the epoch "
        "with exactly the rows left. Default None: checkpoints at epoch ends only.",
    )
    keep_checkpoints = _checked(
        "keep_checkpoints",
        "How many epoch checkpoints of the run the store keeps: the newest N (an integer >= 1); older ones "
        "are removed after each new one is written whole, never the newest (what a resume starts from) nor "
        "the commits inside the epoch after it, nor, until the fit ends, the checkpoint it resumed from. "
        "Default None: every epoch's checkpoint is kept.",
    )
    backend_env = _checked(
        "backend_env",
        "Environment variables for every rank ({name: value}; horovod.spark's backend_env). They win over "
        "hvd_spark's defaults (e.g. TF_NUM_INTEROP_THREADS), not over a rank's identity.",
    )
    mp_start_method = _checked(
        "mp_start_method",
        "How rank processes start (horovod.spark's multiprocessing start method): None or 'fork' / "
        "'forkserver' (forked by the host's warm server, which imported TensorFlow once), 'spawn' (a fresh "
        "Python process per rank).",
    )
    tensorflow_dataset_prefetch_buffer_size = _checked(
        "tensorflow_dataset_prefetch_buffer_size",
        "Batches each rank's tf.data pipeline prepares ahead of training (0, the default: tf.data.AUTOTUNE).",
    )
    partitions_per_process = _checked(
        "partitions_per_process",
        "Parquet files per rank when the data is copied to the store (default: as many as the application's "
        "task slots allow, a multiple of num_proc).",
    )
    transformation_fn = _checked(
        "transformation_fn",
        "A function applied on the ranks to each block of training and validation rows before batching: "
        "it takes and returns a pandas DataFrame of the feature / label / weight columns (the DataFrame's "
        "names; arrays as per-row numpy arrays) with the same rows. Required for a binary feature column "
        "(bytes, e.g. an image), which it decodes; the fitted model's transform then applies it too.",
    )
    train_reader_num_workers = _checked(
        "train_reader_num_workers",
        "Threads each rank reads its training row groups with, ahead of training (default 2).",
    )
    val_reader_num_workers = _checked(
        "val_reader_num_workers", "Threads each rank reads its validation row groups with (default 2)."
    )
    reader_pool_type = _checked(
        "reader_pool_type",
        "'thread' (default: train/val_reader_num_workers threads read ahead) or 'dummy' (row groups are read "
        "in the training loop's thread). 'process' is refused.",
    )
    label_shapes = _checked(
        "label_shapes",
        "The shape each label column's values take for the model (one list of ints per label; default: the "
        "output's shape).",
    )
    checkpoint_callback = _checked(
        "checkpoint_callback",
        "A keras.callbacks.ModelCheckpoint run on rank 0: with save_best_only, fit returns the best model by "
        "its monitor and mode instead of the last one. Its filepath is replaced by one in the run.",
    )
    inmemory_cache_all = _checked(
        "inmemory_cache_all",
        "Keep every row group a rank has read in its memory (decoded), so later epochs read no files. "
        "Costs up to the whole training and validation data in each rank's memory. Default False.",
    )
    data_module = _checked("data_module", "horovod.spark's NVTabular data module: not supported (None only).")
    continuous_cols = _checked("continuous_cols", "horovod.spark's NVTabular columns: not supported (None only).")
    categorical_cols = _checked("categorical_cols", "horovod.spark's NVTabular columns: not supported (None only).")
    backward_passes_per_step = _checked(
        "backward_passes_per_step",
        "Batches whose gradients each rank accumulates before one allreduce and update (Keras' "
        "gradient_accumulation_steps; like a batch this many times larger, with as many fewer "
        "allreduces). Default 1.",
    )
    gradient_compression = _checked(
        "gradient_compression",
        "'none' (default) or 'fp16': gradients travel as float16 in the allreduce (half the bytes).",
    )
    start_timeout = _checked("start_timeout", "Seconds for all ranks to start (default 600).")
    use_gpu = _checked(
        "use_gpu",
        "Each rank trains on exactly its barrier task's Spark-assigned GPUs (CUDA_VISIBLE_DEVICES, NCCL "
        "when Horovod has it). Default: True when spark.task.resource.gpu.amount is set.",
    )
    stall_timeout = _checked(
        "stall_timeout",
        "Seconds without progress of any rank (a step, an epoch boundary) after which training is "
        "stopped as stalled, then restarted (max_restarts) or failed (default 300; 0: off).",
    )
    mlflow = _checked(
        "mlflow",
        "MLflow tracking of the fit (extra 'mlflow'): 'auto' (default: when an MLflow run is active on "
        "the driver), 'on' (also starts a run when none is active) or 'off'. Logs the params, each "
        "epoch's metrics (over all ranks' rows) as they arrive, the run id and store paths, and the model.",
    )
