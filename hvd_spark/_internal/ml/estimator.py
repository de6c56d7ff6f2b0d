"""``HorovodEstimator``: fit a Keras 3 model on a Spark DataFrame with Horovod ring-allreduce."""

import dataclasses
import os
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark._internal.data import fit_data
from hvd_spark._internal.data.store import Store
from hvd_spark._internal.ml import persistence, steps
from hvd_spark._internal.ml.fit_params import DEFAULTS, FitParams, fit_arguments_error, is_backend_object
from hvd_spark._internal.ml.params import EstimatorParams


class HorovodEstimator(Estimator, EstimatorParams, MLWritable, MLReadable):
    """Trains a Keras 3 model on a DataFrame with data-parallel synchronous SGD over Horovod.

    ``fit(df)`` checks the DataFrame against the model, reads a plain scan of Parquet files in place
    or writes the needed columns to Parquet in the store (reused by later fits of the same data),
    runs ``num_proc`` Horovod ranks as one Spark barrier stage, each training on its own share of
    every epoch's rows (a contiguous part of the epoch's order, drawn from any of the files and
    moving every epoch; no row twice in an epoch, the ``rows % num_proc`` left over sit it out;
    ``reader="petastorm"``: each rank its own files) with gradients averaged by ring-allreduce,
    checkpoints after every epoch and returns a :class:`TFTransformer`. A Spark job of the data's
    preparation that fails raises :class:`~hvd_spark.DataPreparationError`.

    Parameter names and meanings follow ``horovod.spark.keras.KerasEstimator``; differences:
    an existing ``run_id`` resumes at the next epoch (``epochs`` is the total), the learning
    rate is used as given (never scaled by ``num_proc``: scale it yourself if you want the
    linear-scaling rule), ``validation`` may be a fraction or a column, and ``backend`` is
    ``"gloo"`` or ``"mpi"`` (or, as there, an object that runs the ranks).

    Every parameter is checked when it is set (the constructor, ``setParams``, ``set<Name>``,
    ``copy``): a value of the wrong type raises ``TypeError`` (a bool where a number is expected, too)
    and one the parameter cannot take ``ValueError`` (out of range, not whole where a count is
    expected, inf or nan, not among the choices), naming the parameter and what it expects. ``fit``
    reads them once, as a typed record. Each default is defined once, in ``fit_params.DEFAULTS``;
    the signature below spells them out. docs/estimator.md holds the table of every parameter, in
    the three groups below; each Param's own doc (``explainParams()``) says the rest.

    Args:
        What the model learns:
        model: a built Keras 3 model (required).
        optimizer, loss, loss_weights, metrics: as for ``model.compile``; default: the model's
            compiled ones. learning_rate replaces the optimizer's learning rate for this fit (a
            number to search in a tuning grid). custom_objects: needed to load the model.
        feature_cols: one column per model input (numeric, array, or Vector), in the model's order
            or as ``{input name: column}``; an entry may be a list of numeric columns stacked into
            one input. label_cols: one column per model output (both required). output_cols:
            prediction columns (default "<label>__output"). sample_weight_col: per-row weight.
        validation: fraction in [0, 1) or the name of a boolean / 0-1 column.
        callbacks: Keras callbacks, run on every rank after metrics are averaged (those that write
            files on rank 0 only, relative paths in the run's ``outputs/``; BackupAndRestore is
            refused: ``run_id`` resumes a run). class_weight, validation_freq: as for ``model.fit``.
        batch_size: rows per training batch per rank (default 32; the global batch is
            ``batch_size * num_proc``); val_batch_size: default batch_size. epochs: the total
            (default 1). train_steps_per_epoch, validation_steps_per_epoch: default one pass.
        shuffle (default True), shuffle_buffer_size (10000), random_seed (0).
        backward_passes_per_step: batches accumulated before one allreduce and update (default 1).
            gradient_compression: ``"none"`` (default) or ``"fp16"``.
        task: ``"auto"`` (default), ``"classification"`` or ``"regression"``: whether ``transform``
            adds Spark ML's ``prediction``, ``probability`` and ``rawPrediction`` columns.
        transformation_fn, label_shapes, checkpoint_callback: horovod.spark's, with its meanings.

        How it runs:
        num_proc: ranks; default one per host with TensorFlow's threads on all its cores
            (``HVD_SPARK_RANK_LAYOUT=slot``: one per task slot).
        store: path / URL / :class:`hvd_spark.Store` reachable from every executor (required).
        run_id: run folder name; default a new one per fit. An existing run resumes.
        verbose: 0, 1 (default: per-epoch progress in the driver's log) or 2.
        backend: ``"gloo"`` (default) or ``"mpi"``; or an object of horovod.spark's ``Backend``
            shape (``run(fn, args, kwargs, env)``, ``num_processes()``) that runs the ranks of each
            training attempt, kept on the estimator (``getBackend()``), never saved.
        backend_env: environment variables for every rank. use_gpu: default True when
            ``spark.task.resource.gpu.amount`` is set (docs/gpu.md).
        start_timeout (default 600 s), stall_timeout (default 300 s; 0: off): seconds.
        max_restarts: restarts of a failed training job from the latest checkpoint (default 0).
        min_num_proc, max_num_proc, elastic_timeout: elastic training (needs max_restarts >= 1).
        checkpoint_every: commits inside an epoch, every N steps or every period (``"90s"``).
        keep_checkpoints: the newest N epoch checkpoints the store keeps of the run (default None: all).
        reader (``"arrow"``, default, or ``"petastorm"``), materialize (``"auto"``, ``"always"``,
            ``"never"``), reuse_data (``"auto"``, ``"always"``, ``"never"``): how the data is read,
            copied and reused (docs/estimator.md).
        mlflow: ``"auto"`` (default: the MLflow run active on the driver), ``"on"`` or ``"off"``.
        mp_start_method, tensorflow_dataset_prefetch_buffer_size, partitions_per_process,
            train_reader_num_workers, val_reader_num_workers, reader_pool_type,
            inmemory_cache_all: horovod.spark's, with its meanings.

        Compatibility:
        data_module, continuous_cols, categorical_cols: horovod.spark's NVTabular params, refused
            unless None.

    Example:
        >>> est = HorovodEstimator(num_proc=2, store="/tmp/store", model=model, optimizer="adam",
        ...                        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        ...                        feature_cols=["features"], label_cols=["label"], epochs=5)  # doctest: +SKIP
        >>> predictions = est.fit(train_df).transform(test_df)    # doctest: +SKIP
    """

    _params_record: type[FitParams] = FitParams  # fit's record of the Params (TorchEstimator's converts its own)
    _framework_params: tuple[str, ...] = ()  # Params of the framework only, not of FitParams (TorchEstimator's)

    @keyword_only
    def __init__(
        self,
        *,
        num_proc: int | None = None,
        store: "str | os.PathLike[str] | Store | None" = None,
        model: Any = None,
        optimizer: Any = None,
        learning_rate: float | None = None,
        loss: Any = None,
        loss_weights: "list[float] | dict[str, float] | None" = None,
        metrics: Any = None,
        custom_objects: dict[str, Any] | None = None,
        feature_cols: "list[str | list[str]] | dict[str, str | list[str]] | None" = None,
        label_cols: list[str] | None = None,
        sample_weight_col: str | None = None,
        validation: float | str | None = None,
        callbacks: list[Any] | None = None,
        class_weight: dict[int, float] | None = None,
        validation_freq: int | list[int] = 1,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        shuffle: bool = True,
        shuffle_buffer_size: int = 10000,
        random_seed: int = 0,
        run_id: str | None = None,
        verbose: int = 1,
        backend: Any = "gloo",
        output_cols: list[str] | None = None,
        start_timeout: float | None = None,
        stall_timeout: float | None = None,
        use_gpu: bool | None = None,
        max_restarts: int = 0,
        min_num_proc: int | None = None,
        max_num_proc: int | None = None,
        elastic_timeout: float | None = None,
        checkpoint_every: int | str | None = None,
        keep_checkpoints: int | None = None,
        backend_env: dict[str, str] | None = None,
        mp_start_method: str | None = None,
        tensorflow_dataset_prefetch_buffer_size: int = 0,
        partitions_per_process: int | None = None,
        transformation_fn: Any = None,
        train_reader_num_workers: int = 2,
        val_reader_num_workers: int = 2,
        reader_pool_type: str = "thread",
        label_shapes: list | None = None,
        checkpoint_callback: Any = None,
        inmemory_cache_all: bool = False,
        data_module: Any = None,
        continuous_cols: Any = None,
        categorical_cols: Any = None,
        backward_passes_per_step: int = 1,
        gradient_compression: str = "none",
        reader: str = "arrow",
        materialize: str = "auto",
        reuse_data: str = "auto",
        task: str = "auto",
        mlflow: str | bool = "auto",
    ):
        super().__init__()
        self._backend_object: Any = None  # a Backend-shaped object given as ``backend``: never a Param value
        self._setDefault(**DEFAULTS)  # the one table of defaults (fit_params.py)
        self.setParams(**self._input_kwargs)  # type: ignore[attr-defined]  # set by @keyword_only

    @keyword_only
    def setParams(self, **kwargs: Any) -> "HorovodEstimator":
        """Sets any of the constructor's parameters."""
        unknown = [k for k in kwargs if not self.hasParam(k)]
        if unknown:
            raise TypeError(f"Unknown HorovodEstimator parameters: {unknown}.")
        return self._set(**kwargs)

    def _set(self, **kwargs: Any) -> "HorovodEstimator":
        """Spark ML's ``_set`` (used by the constructor, setters and ``copy``), with a backend object
        kept beside the Params: it cannot be saved as a Param value."""
        if "backend" in kwargs:
            value = kwargs["backend"]
            if is_backend_object(value):
                self._backend_object = value
                kwargs = {k: v for k, v in kwargs.items() if k != "backend"}
            else:
                self._backend_object = None  # a controller's name (or None: the default) replaces an object
        return super()._set(**kwargs)

    def setBackend(self, value: Any) -> "HorovodEstimator":
        """Sets ``backend``: ``"gloo"``, ``"mpi"`` or an object with ``run`` and ``num_processes``
        (kept on the estimator, not saved). Returns ``self``."""
        return self._set(backend=value)

    def getBackend(self) -> Any:
        """The backend object when one was given, else the controller's name (``"gloo"`` / ``"mpi"``)."""
        return self._backend_object if self._backend_object is not None else self.getOrDefault(self.backend)

    # --- validation (before any work) ---
    def _fit_params(self) -> FitParams:
        """The params as one checked record (each was checked when set; here the required ones and what
        depends on the environment: MLflow installed, the reader's libraries, the backend object)."""
        from hvd_spark._internal.driver.tracking import check_mode
        from hvd_spark._internal.rank.reader import check_reader

        own = self._framework_params
        p = self._params_record.from_params(
            {param.name: self.getOrDefault(param) for param in self.params if param.name not in own}
        )
        check_mode(p.mlflow)
        check_reader(p.reader)
        backend = self._backend_object
        if backend is not None:
            n = backend.num_processes()
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"backend.num_processes() must return a positive integer. Received: {n!r} from "
                    f"{type(backend).__name__}."
                )
            if p.num_proc is not None and p.num_proc != n:
                raise ValueError(
                    f"num_proc must be unset or equal to backend.num_processes() ({n}) when backend is an object. "
                    f"Received: num_proc={p.num_proc}. Leave num_proc unset."
                )
            p = dataclasses.replace(p, num_proc=n)
        return p

    def fit_on_parquet(self, path: str, validation_path: str | None = None, params: dict | None = None):
        """Trains on Parquet files already written, read in place: ``path`` is a file or a folder of
        them (searched recursively) at any URL the store's filesystem reaches (a local path,
        ``s3://`` with the store's storage options, ...), even where Spark has no filesystem for it.
        ``validation_path``: files of validation rows (else the ``validation`` param splits ``path``'s
        rows). Columns are named as in the files; their types are the files'. Returns the
        ``TFTransformer``, like :meth:`fit` (horovod.spark's ``fit_on_parquet`` trains on the store's
        own copy instead).

        Raises:
            ValueError: no Parquet files at ``path``, ``validation_path`` together with the
                ``validation`` param, ``materialize="always"`` (this data is read in place only).
        """
        est = self.copy(params) if params else self
        p = est._fit_params()
        if p.materialize == "always":
            raise ValueError("fit_on_parquet reads its files in place: materialize='always' does not apply to it.")
        if validation_path is not None and p.validation:
            raise ValueError(
                "fit_on_parquet: give either validation_path (files of validation rows) or the validation param "
                f"(a split of path's rows), not both. Received: validation={p.validation!r}, "
                f"validation_path={validation_path!r}."
            )
        from hvd_spark._internal.driver.sessions import active_session

        data = fit_data.parquet_input(path, validation_path, Store.create(p.store), active_session)
        return steps.run(data, p, est._backend_object, est._framework())

    def _framework(self):
        """The model's framework (``ml/framework.py``): Keras here, torch or Lightning in the subclasses."""
        from hvd_spark._internal.ml.framework import KERAS

        return KERAS

    # --- fit: its steps are ml/steps.py's ---
    def fit(self, dataset, params=None, **kwargs):
        """Spark ML's ``fit(dataset, params=None)``: returns the fitted :class:`TFTransformer` (a list of
        param maps: one per map). ``keras.Model.fit``'s keyword arguments (``initial_epoch``,
        ``batch_size``, ``x``, ...) raise ``TypeError`` naming the Param that does their work."""
        if kwargs:
            raise fit_arguments_error(kwargs)
        if not (hasattr(dataset, "sparkSession") and hasattr(dataset, "schema")):  # classic or Connect
            kind = f"{type(dataset).__module__}.{type(dataset).__name__}"
            how = (
                "Convert it first: est.fit(spark.createDataFrame(frame)), or write it to Parquet and fit "
                "spark.read.parquet(path) (read in place, no copy)."
                if kind.startswith("pandas.")
                else "Read your data with Spark first (spark.read.parquet(path), spark.table(name), ...)."
            )
            raise TypeError(f"fit takes a Spark DataFrame. Received: a {kind}. {how}")
        return super().fit(dataset, params)

    def _fit(self, dataset):
        """Spark ML's hook behind ``fit`` (which copies the estimator with ``params`` first): the fit's
        steps (``ml/steps.py``'s ``run``) on the DataFrame."""
        return steps.run(fit_data.FitInput(dataset), self._fit_params(), self._backend_object, self._framework())

    # --- persistence (save / load come from MLWritable / MLReadable) ---
    @classmethod
    def read(cls):
        from hvd_spark._internal.ml.persistence import EstimatorReader

        return EstimatorReader(cls)

    def write(self):
        from hvd_spark._internal.ml.persistence import EstimatorWriter

        return EstimatorWriter(self)


# Spark ML's saved metadata names the class by its module: the public name stays stable.
HorovodEstimator.__module__ = "hvd_spark"

# Saving to an object store Spark's Hadoop cannot reach (s3:// without Hadoop's S3 jars): Spark ML's
# metadata goes through fsspec there, for these stages and the Pipelines holding them (persistence.py).
persistence.install()
