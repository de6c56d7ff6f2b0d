"""``HorovodEstimator``: fit a Keras 3 model on a Spark DataFrame with Horovod ring-allreduce."""

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from typing import Any

import cloudpickle
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark._internal.common import dataplan, retry, settings
from hvd_spark._internal.common.contracts import DataSpec, FitSummary, RankSummary, RunConfig
from hvd_spark._internal.common.specs import (
    check_string_input,
    match_columns,
    specs_to_dicts,
    stack_for_single_input,
    with_stored_names,
)
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.identity import data_identity, dataset_key
from hvd_spark._internal.data.stats import check_stats
from hvd_spark._internal.data.store import Store
from hvd_spark._internal.driver.progress import BATCH_INTERVAL, FitProgress, interactive
from hvd_spark._internal.infer.transformer import TFTransformer
from hvd_spark._internal.ml import controller, persistence, policies
from hvd_spark._internal.ml import plan as plan_mod
from hvd_spark._internal.ml.backend import fit_backend, fit_launch_args, launches_with_spark
from hvd_spark._internal.ml.fit_params import DEFAULTS, FitParams, every_seconds, is_backend_object
from hvd_spark._internal.ml.params import EstimatorParams
from hvd_spark.errors import DataChangedError, HvdSparkError, RankFailedError, RunInUseError

logger = logging.getLogger(__name__)


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

        p = FitParams.from_params({param.name: self.getOrDefault(param) for param in self.params})
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
        from pyspark.sql import SparkSession

        from hvd_spark._internal.data import inplace

        est = self.copy(params) if params else self.copy()
        p = est._fit_params()
        if p.materialize == "always":
            raise ValueError("fit_on_parquet reads its files in place: materialize='always' does not apply to it.")
        if validation_path is not None and p.validation:
            raise ValueError(
                "fit_on_parquet: give either validation_path (files of validation rows) or the validation param "
                f"(a split of path's rows), not both. Received: validation={p.validation!r}, "
                f"validation_path={validation_path!r}."
            )
        store = Store.create(p.store)
        found = {}
        for role, url in (("path", path), ("validation_path", validation_path)):
            if url is None:
                continue
            files = inplace.list_parquet(str(url), inplace.options_for(str(url), store))
            if not files:
                raise ValueError(f"fit_on_parquet: no Parquet files at {role}={url!r}.")
            found[role] = files
        import pyarrow.parquet as pq

        from hvd_spark._internal.common import sources

        fs, first = sources.file_system(found["path"][0], inplace.options_for(found["path"][0], store))
        with fs.open(first, "rb") as f:
            schema = pq.ParquetFile(f).schema_arrow
        spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        frame = spark.createDataFrame([], inplace.spark_schema(schema))
        val_files = set(found.get("validation_path", []))
        found["path"] = [f for f in found["path"] if f not in val_files]  # a validation folder inside path
        if not found["path"]:
            raise ValueError(f"fit_on_parquet: every Parquet file at path={path!r} is a validation_path file.")
        every = tuple(found["path"] + found.get("validation_path", []))
        est._forced_scan = (  # type: ignore[attr-defined]  # read by _read_in_place
            inplace.Scan(every, {n: n for n in schema.names}, str(path), str(path)),
            tuple(found.get("validation_path", ())),
        )
        return est.fit(frame)

    # --- fit, as named steps ---
    def _fit(self, dataset):
        t_start = time.time()
        checked = self._check(dataset)
        run_id = checked.p.run_id or plan_mod.new_run_id()
        with self._run_writer(checked, run_id) as lease:
            return self._fit_run(dataset, checked, run_id, t_start, lease)

    @contextlib.contextmanager
    def _run_writer(self, c: "_Checked", run_id: str):
        """Step 1b: this fit becomes the run's only writer (a lease in the store, refreshed every
        10 s) until it returns; another fit of the same run meanwhile gets RunInUseError before any
        work. A lease whose fit died (no heartbeat for 60 s) is taken over, so the run resumes."""
        from hvd_spark._internal.data.store import LeaseHeldError

        store, folder = c.store, c.store.run_path(run_id)
        path, stale = f"{folder}/_writer.json", settings.run_lease_stale()
        with contextlib.ExitStack() as stack:
            if not store._exists(folder):

                def remove_if_empty() -> None:  # after the lease is gone: no empty folder left by a failed fit
                    # the store is unreachable: an empty folder is harmless, and the fit's outcome comes first
                    with contextlib.suppress(Exception), retry.at_most(settings.LEASE_HEARTBEAT):
                        if not store._listdir(folder):
                            store._rm(folder)

                stack.callback(remove_if_empty)
            try:
                lease = stack.enter_context(
                    store._exclusive_lease(path, heartbeat=settings.LEASE_HEARTBEAT, stale=stale, run_id=run_id)
                )
            except LeaseHeldError as e:
                h = e.holder
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h.get("started", 0) or 0)))
                raise RunInUseError(
                    f"run_id '{run_id}' in {store.prefix} is being trained by another fit right now (host "
                    f"{h.get('host', '?')}, pid {h.get('pid', '?')}, started {started}, last heartbeat "
                    f"{time.time() - float(h.get('heartbeat', 0) or 0):.0f}s ago). Wait for it to finish, or use "
                    f"another run_id. A fit that died leaves its lease ({path}); it expires {stale:g}s after its "
                    f"last heartbeat ({settings.ENV_RUN_LEASE_STALE}).",
                    run_id=run_id,
                    holder={k: v for k, v in h.items() if k != "token"},
                ) from None
            yield lease

    def _fit_run(self, dataset, checked: "_Checked", run_id: str, t_start: float, lease=None):
        plan = self._plan_resume(checked, run_id)
        checked = _read_as_the_run(checked, plan)
        data = self._identify_data(dataset, checked)
        plan_mod.check_data(checked.store, plan, data.record)  # a run goes on with its own data only
        tracker = self._open_tracking(checked, plan)
        try:
            if plan.finished(checked.p.epochs):
                model = self._finished_run(checked, plan)
            else:
                written = self._materialize(dataset, checked, plan, data)
                with _removed_after(checked.store, written):
                    cfg = self._plan_ranks(checked, plan, written, lease)
                    listeners = [tracker.on_event] if tracker else []
                    try:
                        trained = self._train_with_restarts(dataset.sparkSession, checked, cfg, listeners, lease)
                        if written.source is not None:  # a file changed under the ranks: no model of mixed data
                            from hvd_spark._internal.data.inplace import check_unchanged

                            check_unchanged(written.meta["files"], written.source)
                    except (RankFailedError, DataChangedError) as e:
                        changed = isinstance(e, DataChangedError) or e.exc_type.endswith("DataChangedError")
                        if not changed:
                            raise
                        try:
                            _drop_fit(checked.store, plan)  # never resumed, returned, nor the run's newest model
                        except Exception as drop:  # the store is unreachable: the user's error comes first
                            logger.warning("could not remove what the rejected fit wrote: %s", drop)
                        message = e.remote_message if isinstance(e, RankFailedError) else str(e)
                        if plan.resume is not None:
                            message += (
                                f" Run '{plan.run_id}' keeps its checkpoints up to {plan.resume.position}, trained on "
                                "the table before the change; a fit of it on the changed table is refused: fit it "
                                "with a new run_id."
                            )
                        raise DataChangedError(message) from e
                    model = self._verify_and_build(checked, written, cfg, trained, t_start)
        except BaseException:
            if tracker is not None:
                tracker.close(error=True)
            raise
        if tracker is not None:
            self._close_tracking(tracker, checked, model)
        return model

    def _open_tracking(self, c: "_Checked", plan: plan_mod.ResumePlan):
        """MLflow (``mlflow`` param): the run this fit is logged in, or None."""
        from hvd_spark._internal.common.secrets import redacted, url_without_credentials
        from hvd_spark._internal.driver.tracking import FitTracker

        store, run_id = c.store, plan.run_id
        tags = {
            "run_id": run_id,
            "store": url_without_credentials(store.prefix),  # never the storage options (credentials)
            "run_path": store._url(store.run_path(run_id)),
            "model_path": store._url(plan_mod.model_path_of(store, plan, c.p.epochs)),
            "checkpoints_path": store._url(store.checkpoints_path(run_id)),
            "logs_path": store._url(store.logs_path(run_id)),
            "resumed_from_epoch": str(plan.resume.epoch if plan.resume else 0),
        }
        params = {k: v for k, v in c.p.as_dict().items() if k not in ("mlflow", "verbose")}
        params["run_id"] = run_id
        if params.get("backend_env"):
            params["backend_env"] = redacted(params["backend_env"])  # the ranks' credentials are never logged
        if self._backend_object is not None:
            params["backend"] = self._backend_object
        return FitTracker.open(c.p.mlflow, params, tags)

    def _close_tracking(self, tracker, c: "_Checked", model: "TFTransformer") -> None:
        """Logs the epochs the events missed, the fit's summary and the model. A tracking failure here
        is a warning: the trained model is returned either way."""
        from hvd_spark._internal.driver.tracking import signature

        history = model.getHistory()
        epochs = max((len(v) for v in history.values()), default=0)
        epoch_logs = [{k: v[i] for k, v in history.items() if i < len(v)} for i in range(epochs)]
        s = model.getFitSummary()
        summary = (
            {
                "fit_seconds": s.fit_seconds,
                "materialize_seconds": s.materialize_seconds,
                "train_job_seconds": s.train_job_seconds,
                "restarts": s.restarts,
            }
            if s
            else {}
        )
        try:
            tracker.close(
                epoch_logs=epoch_logs, summary=summary, model=model.getModel(), sig=signature(c.inputs, c.outputs)
            )
        except Exception as e:
            logger.warning("MLflow: logging the fit's end to run %s failed: %s", tracker.run_id, e, exc_info=True)

    def _check(self, dataset) -> "_Checked":
        """Step 1: params, the model against the columns, launch options. Nothing is written before
        this returns, so every mistake found here leaves the store as it was."""
        from hvd_spark._internal.common.logs import TF_LOG_LEVEL, ensure_visible
        from hvd_spark._internal.common.serde import model_custom_objects
        from hvd_spark._internal.driver.options import resolve_launch_options
        from hvd_spark._internal.driver.prewarm import prewarm
        from hvd_spark._internal.ml.model_info import is_compiled, model_specs, needs_build, prediction_task

        p = self._fit_params()
        ensure_visible(p.verbose)
        spark_launch = launches_with_spark(self._backend_object)  # no object, or a SparkBackend
        if p.elastic and spark_launch:
            from hvd_spark._internal.driver.sessions import is_connect

            if is_connect(dataset.sparkSession):
                raise NotImplementedError(
                    "min_num_proc / max_num_proc (elastic training) count the executors' task slots, which a "
                    "Spark Connect client cannot see. Use a classic session, or a fixed num_proc with max_restarts."
                )
        launch_args = dict(
            warm=False if p.mp_start_method == "spawn" else None,  # horovod.spark's start method: a fresh process
            num_proc=None if p.elastic else p.num_proc,
            layout="slot" if p.elastic else None,  # elastic attempts are sized by task slots
            backend=p.backend,
            start_timeout=p.start_timeout,
            stall_timeout=p.stall_timeout,
            stall_default=settings.DEFAULT_FIT_STALL_TIMEOUT,
            use_gpu=p.use_gpu,
            # verbose=2 shows everything, TF's C++ notices included, unless the driver's env says otherwise
            env=dict(
                {TF_LOG_LEVEL: os.environ.get(TF_LOG_LEVEL, "0")} if p.verbose == 2 else {}, **(p.backend_env or {})
            )
            or None,
        )
        # A SparkBackend given as backend adds its launcher arguments (start_timeout, use_mpi, env, ...).
        options = resolve_launch_options(dataset.sparkSession, **fit_launch_args(self._backend_object, launch_args))
        static = options.master.startswith("local") and not options.master.startswith("local-cluster")
        if p.elastic and static and (p.min_num_proc or 1) > options.slots and spark_launch:
            raise ValueError(
                f"min_num_proc={p.min_num_proc} is more than the {options.slots} task slots of master "
                f"{options.master}, which never change: lower min_num_proc, or use a cluster master."
            )
        if p.elastic:  # the first attempt's ranks: the slots there are, within the bounds (train_with_restarts waits)
            first = p.num_proc or (options.slots if p.max_num_proc is None else min(options.slots, p.max_num_proc))
            options = dataclasses.replace(options, num_proc=max(1, first))
        if spark_launch:
            # The hosts' warm servers start importing TF now, while the checks and the data's writing run.
            prewarm(dataset.sparkSession, options, background=True)
        model = p.model
        if needs_build(model):  # a subclassed model never called: built as fit's first batch would build it
            _build_from_columns(model, dataset, p.feature_cols)
        inputs, outputs = model_specs(model)
        # Columns in the model's order (matched by name where they are named after its tensors).
        listed = match_columns(p.feature_cols, inputs, "feature_cols", "input")
        features = stack_for_single_input(listed, inputs)
        if features is not listed:  # several columns for a one-input model: stacked only if all are scalars
            wide = [c for c in listed if data_mod.column_info(dataset, c, "feature").kind != "scalar"]
            if wide:
                raise ValueError(
                    f"feature_cols must name one column per model input (1: {[s.name for s in inputs]}). "
                    f"Received: {listed}. Several columns feed one input only when each holds one number per row "
                    f"(they are stacked in order); {wide} hold several."
                )
        labels = match_columns(p.label_cols, outputs, "label_cols", "output")
        if p.label_shapes is not None:  # given in label_cols' order: follow the columns to the model's order
            if not isinstance(p.label_cols, (list, tuple)):
                raise ValueError("label_shapes needs label_cols as a list (its shapes follow the list's order).")
            if len(p.label_shapes) == len(p.label_cols):
                p = dataclasses.replace(p, label_shapes=[p.label_shapes[list(p.label_cols).index(c)] for c in labels])
        output_cols = p.output_cols
        if isinstance(output_cols, dict):
            output_cols = match_columns(output_cols, outputs, "output_cols", "output")
        p = dataclasses.replace(p, feature_cols=features, label_cols=labels, output_cols=output_cols)
        if len(features) != len(inputs):
            raise ValueError(
                f"feature_cols must name one column per model input ({len(inputs)}: "
                f"{[s.name for s in inputs]}). Received: {features}."
            )
        if len(labels) != len(outputs):
            raise ValueError(
                f"label_cols must name one column per model output ({len(outputs)}: "
                f"{[s.name for s in outputs]}). Received: {labels}."
            )
        if p.output_cols and len(p.output_cols) != len(outputs):
            raise ValueError(
                f"output_cols must name one column per model output ({len(outputs)}). Received: {p.output_cols}."
            )
        if not is_compiled(model) and (p.optimizer is None or p.loss is None):
            raise ValueError(
                "The model is not compiled, so optimizer and loss are required. Received: "
                f"optimizer={p.optimizer!r}, loss={p.loss!r}. Pass both, or compile the model."
            )
        if p.learning_rate is not None:
            _check_settable_learning_rate(p.optimizer if p.optimizer is not None else model.optimizer)
        loss = p.loss if p.loss is not None else getattr(model, "loss", None)
        prediction = prediction_task(p.task, loss, outputs)
        f_infos = [data_mod.column_info(dataset, c, "feature") for c in features]
        for info, spec in zip(f_infos, inputs):
            check_string_input(info.name, info.element_type, spec)
        l_infos = [data_mod.column_info(dataset, c, "label") for c in labels]
        w_info = data_mod.column_info(dataset, p.sample_weight_col, "sample weight") if p.sample_weight_col else None
        if w_info is not None and w_info.kind != "scalar":
            raise TypeError(f"sample weight column '{w_info.name}' must be numeric. Received an {w_info.kind} column.")
        if p.class_weight is not None:
            if len(outputs) != 1:
                raise ValueError(
                    f"class_weight is for a model with a single output, as in keras.Model.fit. Received a model with "
                    f"{len(outputs)} outputs ({[o.name for o in outputs]}): weight the rows with sample_weight_col."
                )
            if p.sample_weight_col:
                raise ValueError(
                    "class_weight and sample_weight_col cannot both be set (keras.Model.fit refuses class_weight "
                    f"with sample weights). Received: sample_weight_col={p.sample_weight_col!r}. Fold the class "
                    "weights into the sample weight column instead."
                )
        validation = p.validation or None
        if isinstance(validation, str):
            vinfo = data_mod.column_info(dataset, validation, "validation")
            if vinfo.kind != "scalar":
                raise TypeError(
                    f"validation column '{validation}' must be boolean or 0/1. Received an {vinfo.kind} column."
                )
        custom_objects = model_custom_objects(model, p.custom_objects, (p.optimizer, p.loss, p.metrics)) or None
        if p.label_shapes is not None:
            _check_label_shapes(p.label_shapes, labels, outputs)
        if p.transformation_fn is not None and p.reader != "arrow":
            raise ValueError("transformation_fn needs reader='arrow' (the rank applies it to the rows it reads).")
        _check_callbacks(p.callbacks)
        for name, value in (
            ("callbacks", p.callbacks),
            ("custom_objects", custom_objects),
            ("transformation_fn", p.transformation_fn),
            ("checkpoint_callback", p.checkpoint_callback),
        ):
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise TypeError(
                    f"{name} must be picklable with cloudpickle: every rank receives a copy. Received: {value!r} ({e})."
                ) from e
        store = Store.create(p.store)
        store._check_writable()
        forced = getattr(self, "_forced_scan", None)
        source, how = _read_in_place(dataset, p, f_infos, l_infos, w_info, validation, store, forced)
        return _Checked(
            p,
            model,
            inputs,
            outputs,
            f_infos,
            l_infos,
            w_info,
            validation,
            options,
            custom_objects,
            store,
            prediction,
            source,
            "" if source is not None else how,
        )

    def _plan_resume(self, c: "_Checked", run_id: str) -> plan_mod.ResumePlan:
        """Step 2: the run id, and the checkpoint to continue from (a run with checkpoints continues
        only with the same architecture and columns): ``plan.plan_resume`` over this model's records."""
        from hvd_spark._internal.ml.model_info import architecture, architecture_fingerprint, model_fingerprint

        p = c.p
        arch = architecture(c.model, p.optimizer, p.loss, {"features": p.feature_cols, "labels": p.label_cols})
        return plan_mod.plan_resume(
            c.store,
            run_id,
            fingerprint=architecture_fingerprint(arch),
            architecture=arch,
            feature_cols=p.feature_cols,
            label_cols=p.label_cols,
            legacy_fingerprint=lambda: model_fingerprint(c.model),
        )

    def _identify_data(self, dataset, c: "_Checked") -> "_Identified":
        """Step 2b: what names the fit's data, for the run's record (``plan.check_data``), found without
        writing anything: a table read in place by its files as step 1 listed them; a copy by
        ``data_identity`` (the query and its input files: one listing job, reused by step 3); both with
        what splits them. Nothing of the layout (ranks, files): an elastic or resized run keeps its data."""
        p = c.p
        fraction = bool(c.validation) and not isinstance(c.validation, str)
        record: dict[str, Any] = {
            "validation": c.validation,
            "random_seed": p.random_seed if fraction else None,
            "sample_weight_col": p.sample_weight_col,
        }
        if c.source is not None:
            from hvd_spark._internal.data import inplace

            scan, status, _, val_files = c.source
            record.update(
                read="in place",
                table=scan.table,
                root=scan.root or inplace.table_root(scan.files),
                files=sorted([url, int(st[0]), int(st[1])] for url, st in zip(scan.files, status)),
                validation_files=sorted(val_files) or None,
            )
            return _Identified(record, None)
        identity = data_identity(dataset, "auto")
        identified = identity.established and "session" not in identity.kinds
        record.update(read="copied", why_copied=c.copy_reason, identified=identified)
        if identified:
            # the plan's semanticHash names rows held in it (the same in every JVM: no file source in it); a
            # Range's rows are named by the query's text, and its hash changes with its partitions
            local_rows = set(identity.kinds) <= {"content"} and identity.local_rows
            in_plan = str(dataset.semanticHash()) if local_rows else None
            record.update(query=identity.query, rows_in_plan=in_plan, files=[list(st) for st in identity.status])
        else:
            record["why"] = (
                identity.reason
                if not identity.established
                else "an RDD or a cache of the Spark application that fitted it, which no other application can name"
            )
        return _Identified(record, identity)

    def _finished_run(self, c: "_Checked", plan: plan_mod.ResumePlan):
        """A run that already has the requested epochs: its model, without training."""
        assert plan.resume is not None
        epochs = c.p.epochs
        logger.info(
            "run '%s' already has %d of %d epochs; returning its model without training",
            plan.run_id,
            plan.resume.epoch,
            epochs,
        )
        model_path = plan_mod.model_path_of(c.store, plan, epochs)  # the asked epoch's checkpoint: never rewritten
        return self._transformer(c, model_path, plan.run_id, plan.history[:epochs])

    def _materialize(self, dataset, c: "_Checked", plan: plan_mod.ResumePlan, ident: "_Identified") -> "_Written":
        """Step 3: the data written to Parquet in the store in one pass over the input, its values
        checked (nulls, lengths, class indices) in the same pass; or the same data, written before and
        provably unchanged, reused (``reuse_data``). ``ident``: step 2b's record (a table that turns out
        not to be readable in place is checked against the run again, as a copy, before it is written)."""
        seed = c.p.random_seed
        num_proc = c.options.num_proc
        named_f, named_l, (w_info,) = with_stored_names(c.f_infos, c.l_infos, [c.w_info])
        f_infos = [i for i in named_f if i is not None]  # features and labels are never None
        l_infos = [i for i in named_l if i is not None]
        columns = f_infos + l_infos + ([w_info] if w_info else [])
        t0 = time.time()
        shapes = tuple(tuple(s) for s in c.p.label_shapes) if c.p.label_shapes else None
        data = DataSpec(tuple(f_infos), tuple(l_infos), w_info, tuple(c.inputs), tuple(c.outputs), shapes)

        from hvd_spark._internal.ml.model_info import class_index_outputs

        loss = c.p.loss if c.p.loss is not None else getattr(c.model, "loss", None)
        indices = class_index_outputs(loss, c.outputs)

        def check(stats: dict) -> None:
            check_stats(stats, f_infos, l_infos, w_info, c.inputs, c.outputs, c.validation, num_proc, indices)

        if c.source is not None:  # the ranks read the table's own files: one pass for the statistics, no copy
            from hvd_spark._internal.data import inplace

            source = _table_source(c.source, f_infos, l_infos, w_info, c.validation, seed)
            reuse = c.p.reuse_data != "never"
            try:
                from hvd_spark._internal.common.topology import is_local_master
                from hvd_spark._internal.driver.sessions import is_connect

                spark = dataset.sparkSession
                meta = inplace.scan_table(
                    spark,
                    c.store,
                    c.source[0],
                    source,
                    reuse=reuse,
                    check=check,
                    slots=c.options.slots,
                    on_driver=is_local_master(c.options.master) and not is_connect(spark),
                )
                return _Written(
                    data,
                    meta["key"],
                    meta,
                    seed,
                    time.time() - t0,
                    ephemeral=not reuse,
                    source=source,
                    record=ident.record,
                )
            except inplace.NotReadableInPlace as e:
                if c.p.materialize == "never" or getattr(self, "_forced_scan", None) is not None:
                    raise ValueError(f"The table cannot be read in place: {e}.") from None
                logger.warning("copying the data to the store: it cannot be read in place because %s", e)
                c = dataclasses.replace(c, source=None, copy_reason=str(e))
                ident = self._identify_data(dataset, c)
                ident = dataclasses.replace(ident, record=dict(ident.record, fell_back=True))  # _read_as_the_run
                plan_mod.check_data(c.store, plan, ident.record)  # the copy splits its own way
        prepared = data_mod.prepare(dataset, f_infos, l_infos, w_info, c.validation, seed)
        if c.p.reuse_data == "auto" and ident.identity is not None:
            identity = ident.identity
        else:
            identity = data_identity(dataset, c.p.reuse_data)
        if not identity.established:
            logger.info("writing the data anew (it will not be reused by later fits): %s", identity.reason)
        else:
            logger.debug("data identity: %s", identity.reason)
        key = dataset_key(prepared, columns, c.validation, seed, identity)
        # 4 bytes a value; a string is taken as 64 (row groups of the copy are sized from this)
        row_values = sum((16 if s.dtype == "string" else s.elements or 1) for s in c.inputs)
        row_values += sum((s.elements or 1) for s in c.outputs) + 1
        meta = data_mod.materialize(
            prepared,
            c.store,
            key,
            columns,
            row_values * 4,
            num_proc,
            check=check,
            files=num_proc * c.p.partitions_per_process
            if c.p.partitions_per_process
            else data_mod.num_files(num_proc, c.options.slots),
        )
        return _Written(
            data, key, meta, seed, time.time() - t0, ephemeral=not identity.established, record=ident.record
        )

    def _plan_ranks(self, c: "_Checked", plan: plan_mod.ResumePlan, w: "_Written", lease=None) -> RunConfig:
        """Step 4: files per rank, steps per epoch, the run's record and the run configuration."""
        from hvd_spark._internal.common.serde import dumps_keras_obj
        from hvd_spark._internal.ml.model_info import compile_extras

        p, meta, num_proc = c.p, w.meta, c.options.num_proc
        if (len(meta["train_files"]) < num_proc and p.reader == "petastorm") or meta["train_rows"] < num_proc:
            logger.warning(
                "%d training rows in %d file(s) for %d processes: some ranks read the same rows",
                meta["train_rows"],
                len(meta["train_files"]),
                num_proc,
            )
        train_paths = tuple(path for path, _ in meta["train_files"])
        units: tuple[tuple[int, int, int], ...] = ()
        val_units: tuple[tuple[int, int, int], ...] = ()
        if w.source is not None:  # the table's own files: row groups with rows of each split
            train_paths = tuple(meta["files"])
            units = tuple((f, g, t) for f, g, t, _ in meta["units"] if t)
            val_units = tuple((f, g, v) for f, g, _, v in meta["units"] if v)
        elif p.reader == "arrow":  # the data plan: every rank reads its share of any row group
            units = tuple(
                (u.file, u.group, u.rows) for u in dataplan.row_groups(train_paths, c.store._parquet_metadata)
            )
        every = p.checkpoint_every
        batch_size, val_batch = p.batch_size, p.val_batch
        # a new run, or one that failed before its first checkpoint: what it trains
        split_rows = {"train": meta["train_rows"], "val": meta["val_rows"]}
        plan_mod.record_run(
            c.store,
            plan,
            feature_cols=p.feature_cols,
            label_cols=p.label_cols,
            data_key=w.key,
            data=dict(w.record, rows=split_rows) if w.record is not None else None,
        )
        comp = {
            k: (dumps_keras_obj(v) if v is not None else None)
            for k, v in (("optimizer", p.optimizer), ("loss", p.loss), ("metrics", p.metrics))
        }
        comp["loss_weights"] = p.loss_weights
        comp["learning_rate"] = p.learning_rate
        comp.update(compile_extras(c.model, p.optimizer))
        cfg = RunConfig(
            store=c.store._job_config(),
            run_id=plan.run_id,
            epochs=p.epochs,
            compile=comp,
            custom_objects=cloudpickle.dumps(c.custom_objects) if c.custom_objects else None,
            callbacks=cloudpickle.dumps(list(p.callbacks)) if p.callbacks else None,
            data=w.data,
            train_files=[],
            val_files=None,
            batch_size=batch_size,
            val_batch_size=val_batch,
            steps_per_epoch=1,
            validation_steps=None,
            shuffle=p.shuffle,
            shuffle_buffer_size=p.shuffle_buffer_size,
            seed=w.seed,
            verbose=p.verbose,
            progress_interval=BATCH_INTERVAL if p.verbose and interactive() else 0.0,
            reader=p.reader,
            num_threads=c.options.num_threads,
            backward_passes_per_step=p.backward_passes_per_step,
            compression=p.gradient_compression,
            final_model=c.store.model_path(plan.run_id, plan.fit_id),
            lease=(lease.path, lease.token) if lease is not None else None,
            validation_exact=p.validation_steps_per_epoch is None,
            train_paths=train_paths,
            train_units=units,
            train_table=tuple((path, int(rows)) for path, rows in meta["train_files"]),
            val_table=tuple((path, int(rows)) for path, rows in meta["val_files"])
            if meta["val_rows"] and w.source is None
            else (),
            val_units=val_units,
            source=w.source,
            fixed_steps=p.train_steps_per_epoch,
            fixed_val_steps=p.validation_steps_per_epoch,
            checkpoint_steps=every if isinstance(every, int) else None,
            checkpoint_seconds=every_seconds(every),
            resize_marker=f"{c.store.run_path(plan.run_id)}/_resize.json" if p.elastic else None,
            prefetch=p.tensorflow_dataset_prefetch_buffer_size,
            reader_workers=(1, 1)
            if p.reader_pool_type == "dummy"
            else (p.train_reader_num_workers, p.val_reader_num_workers),
            transformation_fn=cloudpickle.dumps(p.transformation_fn) if p.transformation_fn else None,
            cache_all=p.inmemory_cache_all,
            checkpoint_callback=cloudpickle.dumps(p.checkpoint_callback) if p.checkpoint_callback else None,
            class_weight=p.class_weight,
            validation_freq=tuple(p.validation_freq) if isinstance(p.validation_freq, list) else p.validation_freq,
        )
        cfg = controller.sized(cfg, num_proc)
        logger.info(
            "training run '%s' on %d ranks: %d train rows, %d val rows, %d steps/epoch, batch %d per rank",
            plan.run_id,
            num_proc,
            meta["train_rows"],
            meta["val_rows"],
            cfg.steps_per_epoch,
            batch_size,
        )
        return cfg

    def _train_with_restarts(
        self, spark, c: "_Checked", cfg: RunConfig, listeners=(), lease=None
    ) -> controller.Trained:
        """Step 5: the training attempts (``controller.train_with_restarts``), each through the fit's backend:
        a Spark barrier stage running ``rank/train.py``'s ``train`` by default (``backend.fit_backend``).

        Returns the ranks' results, the number of restarts, the seconds the attempts took and the
        recoveries (restarts and resizes).
        """
        from hvd_spark._internal.common.serde import model_to_bytes

        store = c.store
        probe = controller.AttemptProbe()
        progress = FitProgress(c.p.verbose, bar=cfg.progress_interval > 0, listeners=[*listeners, probe])
        backend, rank_fn = fit_backend(
            self._backend_object,
            spark=spark,
            options=c.options,
            on_event=progress,
            description="HorovodEstimator.fit",
            channel=(store, f"{store.run_path(cfg.run_id)}/_live"),  # progress on Spark Connect
        )
        elastic = None
        if c.p.elastic:
            elastic = policies.Elastic(
                min_num_proc=c.p.min_num_proc or 1,
                max_num_proc=c.p.max_num_proc,
                timeout=settings.ELASTIC_TIMEOUT.get(c.p.elastic_timeout),
                poll=settings.ELASTIC_POLL.get(),
                initial=c.p.num_proc,
            )
        trained = controller.train_with_restarts(
            backend,
            rank_fn,
            cfg,
            store,
            max_restarts=c.p.max_restarts,
            model_bytes=lambda: model_to_bytes(c.model),
            lease=lease,
            elastic=elastic,
            probe=probe,
        )
        return trained

    def _verify_and_build(self, c: "_Checked", w: "_Written", cfg: RunConfig, trained: controller.Trained, t_start):
        """Step 6: every rank ended with the same weights (what proves the averaging); the model."""
        results, restarts, t_train = trained.results, trained.restarts, trained.seconds

        digests = {r["weights_digest"] for r in results}
        if len(digests) > 1:
            raise HvdSparkError(
                f"Ranks ended training with different weights ({len(digests)} distinct digests); "
                "gradient averaging did not hold. Please report this with your model."
            )
        epoch_logs = results[0]["epoch_logs"]
        start = results[0].get("startup") or {}
        if start:
            logger.info(
                "rank 0 started %s: process %.2fs, horovod init %.2fs, model %.2fs, data %.2fs; first epoch %.2fs",
                "warm (forked)" if start.get("warm") else "cold (fresh process)",
                *(start.get(k, 0.0) for k in ("process", "horovod_init", "model", "data", "first_epoch")),
            )
        logger.info(
            "fit of run '%s' took %.1fs (materialize %.1fs, training job %.1fs)",
            cfg.run_id,
            time.time() - t_start,
            w.seconds,
            t_train,
        )
        summary = FitSummary(
            run_id=cfg.run_id,
            data_key=w.key,
            steps_per_epoch=cfg.steps_per_epoch,
            restarts=restarts,
            materialize_seconds=w.seconds,
            train_job_seconds=t_train,
            fit_seconds=time.time() - t_start,
            ranks=tuple(RankSummary.from_result(r) for r in sorted(results, key=lambda r: r["rank"])),
            recoveries=trained.recoveries,
        )
        model = self._transformer(c, cfg.final_model, cfg.run_id, epoch_logs)
        model._fit_summary = summary
        return model

    def _transformer(self, c: "_Checked", model_path: str, run_id: str, epoch_logs: list) -> TFTransformer:
        """The fitted model: the trained (or finished run's) file, with the fit's columns and specs."""
        from hvd_spark._internal.common.contracts import history_from

        return TFTransformer(
            model_url=c.store._url(model_path),
            storage_options=c.store.storage_options,
            feature_cols=c.p.feature_cols,
            label_cols=c.p.label_cols,
            output_cols=c.p.output_cols,
            input_specs=specs_to_dicts(c.inputs),
            output_specs=specs_to_dicts(c.outputs),
            history=history_from(epoch_logs),
            run_id=run_id,
            custom_objects=c.custom_objects,
            task=c.prediction[0],
            from_logits=c.prediction[1],
            output_vectors=[i.kind == "vector" for i in c.l_infos],
        )

    # --- persistence (save / load come from MLWritable / MLReadable) ---
    @classmethod
    def read(cls):
        from hvd_spark._internal.ml.persistence import EstimatorReader

        return EstimatorReader(cls)

    def write(self):
        from hvd_spark._internal.ml.persistence import EstimatorWriter

        return EstimatorWriter(self)


@contextlib.contextmanager
def _removed_after(store: Store, written: "_Written"):
    """While the fit trains, a lease in the data's folder says so (``Store.cleanup`` and
    ``remove_dataset`` leave it alone). Data written for one fit only (its input has no identity to
    reuse it by) is removed when the fit ends, whatever the outcome: nothing would ever read it again."""
    from hvd_spark._internal.data.store import DATA_READER_PREFIX

    reader = f"{store._data_path(written.key)}/{DATA_READER_PREFIX}{uuid.uuid4().hex[:12]}.json"
    try:
        with store._lease(reader, settings.LEASE_HEARTBEAT, key=written.key):
            yield
    finally:
        if written.ephemeral:
            try:
                with retry.at_most(settings.LEASE_HEARTBEAT):  # a clean-up: the fit's outcome first
                    store._rm(store._data_path(written.key))
            except Exception as e:  # the store is unreachable: the fit's own outcome matters more
                logger.warning("could not remove this fit's data %s: %s", written.key, e)


def _drop_fit(store: Store, plan: plan_mod.ResumePlan) -> None:
    """Removes what a fit rejected with DataChangedError wrote that would pass for a result: its final
    model (``Store.model_path(run_id)`` would return it and ``Store.runs()`` count it) and its checkpoints
    and commits (resumed from, or returned as a finished run's model). Its callbacks' outputs and logs
    stay: they say what happened."""
    with contextlib.suppress(FileNotFoundError):
        store._rm(store.model_path(plan.run_id, plan.fit_id))
    _drop_checkpoints_after(store, plan)


def _drop_checkpoints_after(store: Store, plan: plan_mod.ResumePlan) -> None:
    """Removes the checkpoints and commits a fit wrote (those after the epoch it resumed from): they hold
    a model trained on a table that changed under it."""

    def order(c) -> tuple[int, float]:  # an epoch's commits come before its end's checkpoint
        return (c.epoch, c.step or float("inf"))

    start = order(plan.resume) if plan.resume else (-1, 0.0)
    for c in store.checkpoints(plan.run_id):
        if order(c) > start:
            for path in (c.meta_path, c.model_path):  # the JSON first: never a JSON without its model
                with contextlib.suppress(FileNotFoundError):
                    store._rm(path)


def _check_label_shapes(shapes, labels, outputs) -> None:
    """horovod.spark's ``label_shapes``: one shape per label, each holding the values its output takes."""
    import math

    if len(shapes) != len(labels):
        raise ValueError(
            f"label_shapes must give one shape per label column ({len(labels)}: {labels}). Received: {shapes}."
        )
    for shape, spec in zip(shapes, outputs):
        if spec.elements is not None and math.prod(shape) not in (spec.elements, 1):
            raise ValueError(
                f"label_shapes: {shape} holds {math.prod(shape)} values; output '{spec.name}' has shape "
                f"{tuple(spec.shape)} ({spec.elements} values; or 1, a class index)."
            )


def _read_in_place(dataset, p: FitParams, f_infos, l_infos, w_info, validation, store: Store, forced=None):
    """Step 1c: whether the ranks read the DataFrame's own Parquet files (``materialize``): the plain
    scan (``inplace.read_plan``) and its files' identity, or None (the data is copied), with the reason.
    The log says which path and why; ``materialize="never"`` on a DataFrame that cannot be read in place
    is refused here, before any work."""
    from hvd_spark._internal.data import inplace

    if forced is not None:  # fit_on_parquet: the files are given
        if p.reader != "arrow":
            raise ValueError(f"fit_on_parquet reads with reader='arrow'. Received: reader={p.reader!r}.")
        decision = inplace.Decision(forced[0], f"fit_on_parquet({forced[0].table!r})")
    elif p.materialize == "always":
        logger.info("copying the data to the store (materialize='always')")
        return None, "materialize='always'"
    elif p.reader != "arrow":
        decision = inplace.Decision(None, f"reader={p.reader!r} reads copies only")
    else:
        needed = [n for i in [*f_infos, *l_infos] for n in (i.parts or (i.name,))]
        needed += [w_info.name] if w_info is not None else []
        needed += [validation] if isinstance(validation, str) else []
        decision = inplace.read_plan(dataset, needed)
    found = None
    if decision.scan is not None:
        scan = decision.scan
        options = inplace.options_for(scan.files[0], store)
        try:
            status = tuple(inplace.list_status(scan.files, options))
            found = (scan, status, options, forced[1] if forced else ())
            named_f, named_l, (named_w,) = with_stored_names(f_infos, l_infos, [w_info])
            source = _table_source(found, named_f, named_l, named_w, validation, p.random_seed)
            inplace.check_first_file(source, scan.files[0])
        except Exception as e:  # noqa: BLE001 - a file Spark lists but the ranks cannot read: copy it
            if forced is not None:
                raise ValueError(f"fit_on_parquet: {forced[0].table!r} cannot be trained on: {e}") from e
            decision = inplace.Decision(None, f"{type(e).__name__}: {e}")
            found = None
    if found is None:
        if p.materialize == "never":
            raise ValueError(
                f"materialize='never': the DataFrame cannot be read in place because {decision.reason}. Ranks read "
                "a plain scan of Parquet files (a path or a catalog table, columns selected, renamed or cast "
                "between numbers). Use materialize='auto' to copy it to the store."
            )
        logger.info("copying the data to the store: it cannot be read in place because %s", decision.reason)
        return None, decision.reason
    logger.info("reading the data in place, without a copy: %s", decision.reason)
    return found, decision.reason


def _read_as_the_run(c: "_Checked", plan: plan_mod.ResumePlan) -> "_Checked":
    """``c`` copying the data when the run's table fell back to a copy (``plan.copy_again``)."""
    reason = plan_mod.copy_again(plan, c.p.materialize) if c.source is not None else None
    if reason is None:
        return c
    logger.info("copying the data to the store, as run '%s' did: %s", plan.run_id, reason)
    return dataclasses.replace(c, source=None, copy_reason=reason)


def _table_source(found, f_infos, l_infos, w_info, validation, seed: int):
    """The ``sources.TableSource`` of a scan found by :func:`_read_in_place` for named columns."""
    from hvd_spark._internal.common import sources
    from hvd_spark._internal.data import inplace

    scan, status, options, val_files = found
    columns = inplace.source_columns([*f_infos, *l_infos], scan, w_info)
    if val_files:
        split: tuple = ("files", tuple(val_files))
    elif isinstance(validation, str):
        split = ("column", scan.source_name(validation))
    elif validation:
        split = ("fraction", float(validation), int(seed))
    else:
        split = ()
    return sources.TableSource(columns, split, status, options, scan.root or inplace.table_root(scan.files))


def _build_from_columns(model, dataset, feature_cols) -> None:
    """Builds a subclassed model that was never called from the feature columns' per-row shapes and
    types, as Keras builds it on the first batch: one input per entry of ``feature_cols`` (all scalar
    columns: one input stacking them, as for a one-input model); a scalar is shape ``(1,)``, an array or
    Vector its length in the first row, a group of stacked columns ``(columns,)``."""
    from hvd_spark._internal.ml.model_info import build_subclassed

    if isinstance(feature_cols, dict):
        raise ValueError(
            f"feature_cols must be a list for a subclassed model that was never called ({type(model).__name__}): "
            f"it has no input names to match a dict's keys. Received: {feature_cols!r}. Pass a list in the order "
            "of the model's inputs, or build the model first (call it once on a batch)."
        )
    entries = list(feature_cols)
    infos = {c: data_mod.column_info(dataset, c, "feature") for c in entries if isinstance(c, str)}
    if entries and len(infos) == len(entries) and all(i.kind == "scalar" for i in infos.values()) and len(entries) > 1:
        if all(i.element_type != "string" for i in infos.values()):
            entries = [list(entries)]  # several plain numbers: one input, stacked
    wide = [c for c, i in infos.items() if i.kind != "scalar"]
    rows: list = []
    if wide:
        from hvd_spark._internal.data.jobs import spark_job

        with spark_job(f"reading the first row of the DataFrame (the lengths of {wide}, to build the model)"):
            rows = dataset.select(*wide).limit(1).collect()
    if wide and not rows:
        raise ValueError(
            "The DataFrame passed to fit() is empty: 0 rows (the model's input shapes come from its rows)."
        )
    shapes, dtypes = [], []
    for entry in entries:
        if isinstance(entry, (list, tuple)):
            group = [data_mod.column_info(dataset, c, "feature") for c in entry]
            shapes.append((len(entry),))
            dtypes.append("int64" if all(i.is_integer for i in group) else "float32")  # stored as a copy stores it
            continue
        info = infos[entry]
        if info.kind == "scalar":
            shapes.append((1,))
        else:
            value = rows[0][entry]
            shapes.append((int(value.size) if hasattr(value, "size") else len(value),))
        if info.element_type == "string":
            dtypes.append("string")
        elif info.is_integer:
            dtypes.append("int64" if info.element_type == "bigint" else "int32")
        else:
            dtypes.append("float32")
    logger.info(
        "building %s (a subclassed model never called) on inputs of shapes %s and dtypes %s",
        type(model).__name__,
        [(None, *s) for s in shapes],
        dtypes,
    )
    build_subclassed(model, shapes, dtypes)


def _check_callbacks(callbacks) -> None:
    """Refuses, before any work, the Keras callbacks that cannot work across ranks as they do in one process."""
    import keras

    for cb in callbacks or ():
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            raise ValueError(
                "callbacks: keras.callbacks.BackupAndRestore cannot restore several ranks (each would restore its "
                "own copy). hvd_spark does what it does: it checkpoints every epoch (and, with checkpoint_every, "
                "inside epochs), a fit with the same run_id resumes from the latest checkpoint, and max_restarts "
                f"restarts a failed job from it. Received: {cb!r}. Remove it and set run_id."
            )
        if not isinstance(cb, keras.callbacks.Callback):
            raise TypeError(f"callbacks must be keras.callbacks.Callback objects. Received: {cb!r}.")


def _check_settable_learning_rate(optimizer) -> None:
    """learning_rate replaces a number; an optimizer built on a schedule would ignore or refuse it."""
    get_config = getattr(optimizer, "get_config", None)  # None: an optimizer's name ("adam")
    current = get_config().get("learning_rate") if callable(get_config) else None  # a schedule: a dict
    if isinstance(current, dict):
        raise ValueError(
            "learning_rate cannot replace the learning rate of an optimizer built with a LearningRateSchedule "
            f"({current.get('class_name')}). Leave learning_rate unset, or build the optimizer with a number."
        )


@dataclasses.dataclass(frozen=True)
class _Checked:
    """What step 1 of a fit established: checked params and everything derived from them."""

    p: FitParams  # columns matched to the model
    model: Any
    inputs: list
    outputs: list
    f_infos: list
    l_infos: list
    w_info: Any
    validation: Any
    options: Any  # options.LaunchOptions
    custom_objects: dict | None
    store: Store
    prediction: tuple[str, bool]  # model_info.prediction_task: (kind, from_logits)
    source: Any = None  # (inplace.Scan, unnamed columns) when the ranks read the table in place
    copy_reason: str = ""  # why the data is copied (when source is None), for the run's data record


@dataclasses.dataclass(frozen=True)
class _Written:
    """Step 3: the materialized data."""

    data: DataSpec
    key: str
    meta: dict
    seed: int
    seconds: float
    ephemeral: bool = False  # written for this fit only (its input has no identity): removed at its end
    source: Any = None  # sources.TableSource: the table is read in place (meta: inplace.scan_table's)
    record: dict | None = None  # step 2b's data record, for run.json


@dataclasses.dataclass(frozen=True)
class _Identified:
    """Step 2b: what names the fit's data (``plan.check_data``'s record) and, for a copy, its identity."""

    record: dict
    identity: Any = None  # identity.DataIdentity under reuse_data="auto" (a copy), reused by step 3


# Spark ML's saved metadata names the class by its module: the public name stays stable.
HorovodEstimator.__module__ = "hvd_spark"

# Saving to an object store Spark's Hadoop cannot reach (s3:// without Hadoop's S3 jars): Spark ML's
# metadata goes through fsspec there, for these stages and the Pipelines holding them (persistence.py).
persistence.install()
