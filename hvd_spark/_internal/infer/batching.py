"""Pure batching of predictions: feature columns in (pandas or Arrow), output columns out.

No Spark here (the fast tests can drive it): rows with null features, null elements, NaNs or
infinities are refused or kept as null predictions, each batch is cut into ``batch_size`` model calls, and outputs are
built as Arrow arrays without per-row Python."""

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hvd_spark._internal.common.specs import TensorSpec, unpack
from hvd_spark.errors import InvalidFeatureError


class ColumnPredictor:
    """A model that predicts columns itself: :func:`predict_columns` hands it the whole call (an
    inference process's :class:`~hvd_spark._internal.infer.remote.RemoteModel` predicts in its own
    process)."""

    def predict_columns(
        self, cols: list, n: int, inputs: list[TensorSpec], outputs: list[TensorSpec], batch_size: int, names
    ) -> list[np.ndarray]:
        raise NotImplementedError


def predict_columns(
    model,
    cols: list,
    n: int,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    batch_size: int,
    names: list[str] | None = None,
) -> list[np.ndarray]:
    """Predicts ``n`` rows given as column values (numpy or pyarrow), ``batch_size`` rows per model call.

    Returns one float64 array of shape (n, values per row) per model output. A
    :class:`ColumnPredictor` (a :class:`~hvd_spark._internal.infer.remote.RemoteModel`: in its own
    process) predicts them itself.
    """
    if isinstance(model, ColumnPredictor):
        return model.predict_columns(cols, n, inputs, outputs, batch_size, names)
    from hvd_spark._internal.rank.model_inputs import to_model_inputs

    if n == 0:  # e.g. a batch whose rows all had a null feature (handleInvalid="keep")
        return [np.zeros((0, spec.elements or 1)) for spec in outputs]
    predict = predictor(model)
    preds: list[list[np.ndarray]] = [[] for _ in outputs]
    for start in range(0, n, batch_size):
        x = to_model_inputs([c[start : start + batch_size] for c in cols], inputs, names)
        y = predict(x)
        ys = unpack(y, outputs)
        for i, out in enumerate(ys):
            preds[i].append(np.asarray(out))
    return [
        (np.concatenate(parts) if parts else np.zeros((0, spec.elements or 0))).reshape(n, -1).astype(np.float64)
        for spec, parts in zip(outputs, preds)
    ]


_PREDICTORS: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()


def predictor(model) -> Callable:
    """The function that predicts one batch with ``model``: inputs (numpy arrays or tensors, as
    ``to_model_inputs`` packs them) in, numpy arrays out, in the model's output structure.

    For a Keras model: the model's own ``predict_step`` (what ``predict_on_batch`` runs) in a
    ``tf.function`` made once per model, called directly, without ``predict_on_batch``'s work per
    call (its distribution wrapper, its structure conversions). Traced once per input structure; the
    batch axis is left open after a second batch size (``reduce_retracing``), so the last, shorter
    batch of a partition does not trace again and again. Anything else: its ``predict_on_batch``."""
    fn = _PREDICTORS.get(model)
    if fn is not None:
        return fn
    step = getattr(model, "predict_step", None)
    if step is None or getattr(model, "run_eagerly", False):
        fn = model.predict_on_batch
    else:
        import tensorflow as tf

        owner = weakref.ref(model)  # the cache's value holds no reference to its key

        def one_step(x):
            owned = owner()
            if owned is None:  # the model is gone: nothing calls this any more
                raise RuntimeError("the model of this predict function was released")
            return owned.predict_step((x,))

        compiled = tf.function(tf.autograph.experimental.do_not_convert(one_step), reduce_retracing=True)

        def fn(x):
            return tf.nest.map_structure(np.asarray, compiled(x))

        fn.compiled = compiled  # type: ignore[attr-defined]  # its traces are visible (tests)

    try:
        _PREDICTORS[model] = fn
    except TypeError:  # a model that takes no weak reference: made again for each batch of rows
        pass
    return fn


_FIX = "handleInvalid='keep' gives such rows null predictions, 'skip' leaves them out"


def _null_error(col: str, nulls: int, n: int) -> InvalidFeatureError:
    return InvalidFeatureError(
        f"Feature column '{col}' has {nulls} null values in a batch of {n} rows; transform() needs "
        f"a value in every row ({_FIX})."
    )


def _null_elements_error(col: str, rows: int, n: int) -> InvalidFeatureError:
    return InvalidFeatureError(
        f"Feature column '{col}' has {rows} rows with null elements in a batch of {n} rows; transform() "
        f"needs a value in every element ({_FIX})."
    )


def _nonfinite_error(col: str, rows: int, n: int) -> InvalidFeatureError:
    return InvalidFeatureError(
        f"Feature column '{col}' has {rows} rows with NaN or infinite values in a batch of {n} rows; "
        f"transform() needs finite numbers, as fit does ({_FIX})."
    )


def _first_invalid(names: list[str], nulls: list[int], n: int, holed: list[int], nonfinite: list[int]) -> None:
    """Raises for the first column with a null value, with rows that hold null elements (``holed``),
    or with rows that hold a NaN or an infinity (``nonfinite``)."""
    for name, count, holes, bad in zip(names, nulls, holed, nonfinite):
        if count:
            raise _null_error(name, count, n)
        if holes:
            raise _null_elements_error(name, holes, n)
        if bad:
            raise _nonfinite_error(name, bad, n)


def short_errors(batches: Iterator) -> Iterator:
    """``batches``, with an :class:`~hvd_spark.errors.InvalidFeatureError` raised as its message alone:
    Spark's Python worker then writes no traceback before it (pyspark >= 4.0), so the user's
    ``PythonException`` reads ``An exception was thrown from the Python worker:`` and then this message.
    Any other error keeps its traceback, in this task and in later ones of a reused worker."""
    try:
        yield from batches
    except InvalidFeatureError as e:
        from hvd_spark._internal.common.internals import hide_udf_worker_traceback

        hide_udf_worker_traceback(e)
        if hasattr(e, "__notes__"):  # e.g. an inference process's traceback (infer/remote.py): noise here
            del e.__notes__
        raise e.with_traceback(None) from None


def _element_rows(arr, bad_values: Callable) -> np.ndarray | None:
    """For a pyarrow list array: a bool mask of the rows holding an element (at any depth) that
    ``bad_values`` (flattened values -> numpy bool mask, or None for none) flags, or None when there is
    none (also for a non-list array). Vectorized: each flagged element's row comes from the rows'
    lengths (null rows hold no values)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not _is_list(arr):
        return None
    values = arr.flatten()  # the values of the rows, whatever the slice and the null rows
    deeper = _element_rows(values, bad_values)
    bad = bad_values(values)
    if deeper is not None:
        bad = deeper if bad is None else bad | deeper
    if bad is None or not bad.any():
        return None
    # The row of each flattened value: flatten() leaves out what null rows hold, so count per row.
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    parents = np.repeat(np.arange(len(arr)), lengths)
    return np.bincount(parents[bad], minlength=len(arr)) > 0


def _null_values(values) -> np.ndarray | None:
    import pyarrow.compute as pc

    if values.null_count == 0:
        return None
    return np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)


def nonfinite_values(values) -> np.ndarray | None:
    """For a pyarrow array of numbers: a bool mask of its NaNs and infinities (a null is neither), or
    None when it has none or is not of floating point (lists: see :func:`nonfinite_rows`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not pa.types.is_floating(values.type):
        return None
    bad = np.asarray(pc.fill_null(pc.invert(pc.is_finite(values)), False).to_numpy(zero_copy_only=False), dtype=bool)
    return bad if bad.any() else None


def null_element_rows(arr) -> np.ndarray | None:
    """For a pyarrow list array: a bool mask of the rows that hold a null element (at any depth), or
    None when there is none (also for a non-list array)."""
    return _element_rows(arr, _null_values)


def nonfinite_rows(arr) -> np.ndarray | None:
    """For a pyarrow array of numbers or lists of them: a bool mask of the rows holding a NaN or an
    infinity (at any depth), or None when there is none."""
    return _element_rows(arr, nonfinite_values) if _is_list(arr) else nonfinite_values(arr)


def _is_list(arr) -> bool:
    import pyarrow as pa

    t = arr.type
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _output_arrays(arrays: list[np.ndarray], outputs: list[TensorSpec], valid: np.ndarray) -> list:
    """The predictions of the valid rows (``arrays``, row-major) as one pyarrow array per output over all
    rows: ``double`` for a single value, ``list<double>`` otherwise; the other rows null. A NaN the
    model gave stays NaN (not null): it is its output."""
    import pyarrow as pa

    n, m = len(valid), int(valid.sum())
    nulls = None if m == n else ~valid
    out = []
    for spec, arr in zip(outputs, arrays):
        if is_scalar(spec):
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
    frames: Iterator,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    feature_cols: list[str],
    output_cols: list[str],
    batch_size: int,
    keep_invalid: bool = False,
    transform: Callable[[list], list] | None = None,
) -> Iterator:
    """Pure batching (pandas): predicts each batch in chunks and yields a Series (one output) or a DataFrame.

    Each frame holds the ``k`` feature columns, then one status column per feature, computed by Spark
    (:func:`feature_status`: 0 a value, 1 null, 2 an array with null elements, 3 a NaN or an infinity),
    since pandas cannot tell a null from a NaN. A row with a null feature, null elements, a NaN or an
    infinity raises (naming the column and the rows), or with ``keep_invalid`` gets null outputs.

    A single-value output is an Arrow-backed Series, so that a NaN the model gave stays NaN (pyspark
    turns a NaN of a numpy-backed Series into a null). A list output is an object Series of arrays
    (None for an invalid row): pyspark turns the NaNs inside into null elements, which
    ``TFTransformer._transform`` turns back into NaN (the model never outputs a null).

    ``transform`` (:func:`column_transformation`): the valid rows' feature columns pass through it
    before the model (the transformer's ``transformation_fn``, which decodes binary columns).
    """
    import pandas as pd  # here: an inference process (remote.py) predicts without it

    k = len(feature_cols)
    for frame in frames:
        n = len(frame)
        status = frame.iloc[:, k : 2 * k].to_numpy(dtype=np.int8)
        if not keep_invalid:
            counts = [(status == kind).sum(axis=0).tolist() for kind in (1, 2, 3)]
            _first_invalid(feature_cols, counts[0], n, counts[1], counts[2])
        valid = ~(status != 0).any(axis=1)
        rows = frame if valid.all() else frame[valid]
        columns = [rows.iloc[:, i].to_numpy() for i in range(k)]
        if transform is not None and len(rows):
            columns = transform(columns)
        arrays = predict_columns(model, columns, len(rows), inputs, outputs, batch_size, feature_cols)
        series = [
            pd.Series(pd.arrays.ArrowExtensionArray(a)) if is_scalar(spec) else a.to_pandas()
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
    transform: Callable[[list], list] | None = None,
) -> Iterator:
    """Pure batching (Arrow): each StructArray of feature columns -> an Arrow array of predictions.

    List features are reshaped from their flat values and list outputs built from flat values
    and offsets: no per-row Python on either side. A null feature, or an array with a null element,
    makes the row invalid, as in :func:`predict_batches`, and so does a NaN or an infinity. ``transform``:
    as in :func:`predict_batches` (the columns reach it as numpy).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    for struct in structs:
        if isinstance(struct, pa.ChunkedArray):
            struct = struct.combine_chunks()
        n = len(struct)
        cols = [struct.field(i) for i in range(struct.type.num_fields)]
        holes = [null_element_rows(c) for c in cols]
        nonfinite = [nonfinite_rows(c) for c in cols]
        if not keep_invalid:
            rows = [[0 if m is None else int(m.sum()) for m in masks] for masks in (holes, nonfinite)]
            _first_invalid(feature_cols, [c.null_count for c in cols], n, rows[0], rows[1])
        valid = np.ones(n, dtype=bool)
        for c, h, f in zip(cols, holes, nonfinite):
            if c.null_count:
                valid &= np.asarray(pc.is_valid(c).to_numpy(zero_copy_only=False), dtype=bool)
            for mask in (h, f):
                if mask is not None:
                    valid &= ~mask
        if not valid.all():
            keep = pa.array(valid)
            cols = [c.filter(keep) for c in cols]
        if transform is not None and valid.any():
            from hvd_spark._internal.rank.rows import column_values

            cols = transform([column_values(c) for c in cols])
        arrays = predict_columns(model, cols, int(valid.sum()), inputs, outputs, batch_size, feature_cols)
        out = _output_arrays(arrays, outputs, valid)
        yield out[0] if len(out) == 1 else pa.StructArray.from_arrays(out, names=list(output_cols))


def column_transformation(fn, infos: list, inputs: list[TensorSpec]) -> Callable[[list], list]:
    """The transformer's ``transformation_fn`` on the feature columns of a batch (one value per feature,
    in ``infos``' order: ``ColumnInfo`` of each, or of each stacked group), as the ranks apply it to
    their blocks of rows (``rank/rows.py``'s ``transformation``: the DataFrame's column names, a binary
    column's bytes decoded into its input's shape); the frame holds the features only."""
    from dataclasses import replace

    from hvd_spark._internal.rank.rows import transformation

    named = [replace(info, stored=f"_f{i}") for i, info in enumerate(infos)]
    apply = transformation(fn, named, [], None, inputs)

    def transform(cols: list) -> list:
        block = {}
        for info, c in zip(named, cols):
            arr = np.asarray(c)
            if info.parts and arr.dtype == object:  # pandas' per-row arrays of a stacked group
                arr = np.stack(list(arr))
            block[info.stored] = arr
        out = apply(block)
        return [out[info.stored] for info in named]

    return transform


def is_scalar(spec: TensorSpec) -> bool:
    return spec.elements == 1
