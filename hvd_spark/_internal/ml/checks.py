"""Step 1 of a fit (``ml/steps.py``): the params, the launch options, the model against the columns,
what the ranks receive, and whether the data is read in place. Nothing is written before
:func:`check` returns, so every mistake found here leaves the store as it was."""

import dataclasses
import logging
import os
from typing import Any

import cloudpickle

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.specs import check_string_input, match_columns, stack_for_single_input
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.fit_data import FitInput, read_in_place
from hvd_spark._internal.data.store import Store
from hvd_spark._internal.ml.backend import fit_launch_args, launches_with_spark
from hvd_spark._internal.ml.fit_params import FitParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checked:
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
    framework: Any = None  # ml/framework.py's Framework: Keras or torch


def check(data: FitInput, p: FitParams, backend_object: Any = None, framework: Any = None) -> Checked:
    """Step 1: params, the model against the columns, launch options. Nothing is written before
    this returns, so every mistake found here leaves the store as it was.

    Args:
        data: what the fit trains on (its DataFrame gives the columns and the session).
        p: the estimator's params, checked (``HorovodEstimator._fit_params``).
        backend_object: the estimator's backend object, if any (``backend``).
        framework: the model's framework (``ml/framework.py``: Keras, or torch), which checks the model.
    """
    from hvd_spark._internal.common.logs import ensure_visible

    dataset = data.frame
    ensure_visible(p.verbose)
    options, executors = _launch_options(dataset.sparkSession, p, backend_object)
    model = p.model
    m = framework.check_model(data, p)
    p, inputs, outputs, prediction = m.p, m.inputs, m.outputs, m.prediction
    f_infos, l_infos, w_info, validation = _column_infos(dataset, p, inputs, outputs)
    custom_objects = framework.shipped(p, model, outputs)
    if executors is not None:  # the executors' Python can run hvd_spark: known before anything is written
        waited = executors.wait(options.start_timeout)
        logger.debug("the executors answered in %.2f s (the fit waited %.2f s)", executors.seconds, waited)
    store = Store.create(p.store)
    store.files.check_writable()
    source, how = read_in_place(
        data,
        f_infos,
        l_infos,
        w_info,
        validation,
        store,
        reader=p.reader,
        materialize=p.materialize,
        seed=p.random_seed,
    )
    return Checked(
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
        framework,
    )


def _launch_options(spark, p: FitParams, backend_object: Any):
    """Step 1a: the launch options (``driver/options.py``'s ``resolve_launch_options``: slots, backend,
    timeouts), and the executors' check, started in the background (``driver/prewarm.py``'s ``prewarm``:
    their Python can run hvd_spark; their warm servers start), whose answer :func:`check` waits for
    (None when the ranks do not run on Spark)."""
    from hvd_spark._internal.common.logs import TF_LOG_LEVEL
    from hvd_spark._internal.driver.options import resolve_launch_options
    from hvd_spark._internal.driver.prewarm import prewarm

    spark_launch = launches_with_spark(backend_object)  # no object, or a SparkBackend
    if p.elastic and spark_launch:
        from hvd_spark._internal.common.sessions import is_connect

        if is_connect(spark):
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
        env=dict({TF_LOG_LEVEL: os.environ.get(TF_LOG_LEVEL, "0")} if p.verbose == 2 else {}, **(p.backend_env or {}))
        or None,
    )
    # A SparkBackend given as backend adds its launcher arguments (start_timeout, use_mpi, env, ...).
    options = resolve_launch_options(spark, **fit_launch_args(backend_object, launch_args))
    static = options.master.startswith("local") and not options.master.startswith("local-cluster")
    if p.elastic and static and (p.min_num_proc or 1) > options.slots and spark_launch:
        raise ValueError(
            f"min_num_proc={p.min_num_proc} is more than the {options.slots} task slots of master "
            f"{options.master}, which never change: lower min_num_proc, or use a cluster master."
        )
    if p.elastic:  # the first attempt's ranks: the slots there are, within the bounds (train_with_restarts waits)
        first = p.num_proc or (options.slots if p.max_num_proc is None else min(options.slots, p.max_num_proc))
        options = dataclasses.replace(options, num_proc=max(1, first))
    executors = None
    if spark_launch:
        # The hosts' warm servers start importing TF now, while the checks and the data's writing run.
        executors = prewarm(spark, options, background=True)
    return options, executors


def _match_model(dataset, p: FitParams, inputs, outputs) -> FitParams:
    """Step 1b: ``p`` with its columns in the model's order (matched by name where they are named after
    its tensors), one per input and per output."""
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
    return p


def _column_infos(dataset, p: FitParams, inputs, outputs):
    """Step 1c: the feature, label and weight columns' descriptions and the validation (a fraction or
    a column's name), each checked against the model and the other params."""
    f_infos = [data_mod.column_info(dataset, c, "feature") for c in p.feature_cols]
    for info, spec in zip(f_infos, inputs):
        check_string_input(info.name, info.element_type, spec)
        if info.kind == "binary" and p.transformation_fn is None:
            raise ValueError(
                f"Feature column '{info.name}' holds bytes (binary), which model input '{spec.name}' (shape "
                f"{tuple(spec.shape)}, {spec.dtype or 'float32'}) cannot take: a binary feature needs a "
                "transformation_fn that decodes it, on the ranks and in transform. Received: transformation_fn=None. "
                "Pass transformation_fn=fn(pandas.DataFrame) -> pandas.DataFrame replacing the column's bytes "
                "with arrays of the input's shape (docs/estimator.md, 'Images and other binary columns')."
            )
    l_infos = [data_mod.column_info(dataset, c, "label") for c in p.label_cols]
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
    return f_infos, l_infos, w_info, validation


def _check_shipped(p: FitParams, model, outputs) -> dict | None:
    """Step 1d: what every rank receives (custom objects, callbacks, functions) can be shipped; returns
    the custom objects the model needs."""
    from hvd_spark._internal.common.serde import model_custom_objects

    custom_objects = model_custom_objects(model, p.custom_objects, (p.optimizer, p.loss, p.metrics)) or None
    if p.label_shapes is not None:
        from hvd_spark._internal.ml.model_info import class_index_outputs

        loss = p.loss if p.loss is not None else getattr(model, "loss", None)
        sparse = class_index_outputs(loss, outputs, p.label_shapes)
        _check_label_shapes(p.label_shapes, p.label_cols, outputs, sparse)
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
    return custom_objects


def _check_label_shapes(shapes, labels, outputs, sparse) -> None:
    """horovod.spark's ``label_shapes``: one shape per label, each holding the values its output takes (or
    one, a class index), or, for an output trained with a sparse cross-entropy (``sparse[i]``), one class
    index per step or pixel (``(12,)`` for an output ``(12, 3)``, ``(H, W)`` for ``(H, W, C)``)."""
    import math

    from hvd_spark._internal.common.specs import class_index_shape, label_values

    if len(shapes) != len(labels):
        raise ValueError(
            f"label_shapes must give one shape per label column ({len(labels)}: {labels}). Received: {shapes}."
        )
    for shape, spec, indices in zip(shapes, outputs, sparse):
        allowed = {spec.elements, 1, *label_values(spec, indices)}
        if spec.elements is not None and math.prod(shape) not in allowed:
            steps = (
                f"; or {math.prod(class_index_shape(spec) or ())}, one class index per step: shape "
                f"{class_index_shape(spec)}, as the loss is a sparse cross-entropy"
                if indices and len(spec.shape) > 1
                else ""
            )
            raise ValueError(
                f"label_shapes: {shape} holds {math.prod(shape)} values; output '{spec.name}' has shape "
                f"{tuple(spec.shape)} ({spec.elements} values; or 1, a class index{steps})."
            )


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
    binary = [c for c, i in infos.items() if i.kind == "binary"]
    if binary:
        raise ValueError(
            f"A subclassed model that was never called ({type(model).__name__}) is built from its feature columns' "
            f"shapes; {binary} hold bytes, whose decoded shape only transformation_fn knows. Received: a model "
            "without input shapes. Build the model first (call it once on a decoded batch)."
        )
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
            shapes.append((len(entry),))
            dtypes.append(_column_dtype(dataset, entry) or "float32")
            continue
        info = infos[entry]
        if info.kind == "scalar":
            shapes.append((1,))
        else:
            value = rows[0][entry]
            shapes.append((int(value.size) if hasattr(value, "size") else len(value),))
        dtypes.append(_column_dtype(dataset, entry) or "float32")
    logger.info(
        "building %s (a subclassed model never called) on inputs of shapes %s and dtypes %s",
        type(model).__name__,
        [(None, *s) for s in shapes],
        dtypes,
    )
    build_subclassed(model, shapes, dtypes)


def _column_dtype(dataset, entry) -> str | None:
    """The dtype a subclassed model's input gets from ``entry`` (a column, or scalar columns stacked), as
    fit's first batch holds it (a copy stores it so): integers int32 (bigint: int64; stacked integers:
    int64), strings string, other numbers float32; None for bytes (decoded by transformation_fn)."""
    info = data_mod.column_info(dataset, entry, "feature")
    if info.kind == "binary":
        return None
    if info.element_type == "string":
        return "string"
    if info.is_integer:
        return "int64" if info.parts or info.element_type == "bigint" else "int32"
    return "float32"


def _fed_dtypes(model, dataset, feature_cols, inputs, outputs):
    """A subclassed model's specs with the dtypes of the columns that feed it (``feature_cols`` in the
    model's order): its build config keeps no dtypes, and a model called once on int64 ids would otherwise
    be fed float32 on the ranks and in transform (ids above 2^24 would become other ids)."""
    from hvd_spark._internal.ml.model_info import fed_by_columns, model_specs

    if not fed_by_columns(model):
        return inputs, outputs
    dtypes = [_column_dtype(dataset, c) or s.dtype for c, s in zip(feature_cols, inputs)]
    if dtypes == [s.dtype for s in inputs]:
        return inputs, outputs
    logger.info("%s (subclassed) takes its inputs as its columns hold them: dtypes %s", type(model).__name__, dtypes)
    return model_specs(model, input_dtypes=dtypes)


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
