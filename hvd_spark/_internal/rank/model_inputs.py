"""The arrays a model takes for inference, from a UDF worker's column values (pyarrow arrays, numpy or
pandas): list columns reshaped from their flat values (no per-row Python), each row's length checked,
integers checked against the input's type. TensorFlow is imported only for a string input (Keras takes
strings as a ``tf.string`` tensor), so a torch model's transform never loads it.
"""

from collections.abc import Sequence

import numpy as np

from hvd_spark._internal.common.specs import TensorSpec, pack
from hvd_spark._internal.rank.rows import column_values
from hvd_spark.errors import InvalidFeatureError


def _check_list_rows(column, spec: TensorSpec) -> None:
    """Every row of a list column must hold what the input takes: the same length at the top level
    (a flat reshape would otherwise silently mix rows) and ``spec.elements`` values in all."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or len(column) == 0:
        return
    lengths = pc.min_max(pc.list_value_length(column))
    low, high = lengths["min"].as_py(), lengths["max"].as_py()
    if low != high:
        raise ValueError(f"its rows hold from {low} to {high} values; every row must have the same length.")
    inner = _inner(column.type)
    if spec.elements is not None and spec.shape and inner is not None and low * inner != spec.elements:
        raise ValueError(f"its rows hold {low * inner} values.")


def _inner(list_type) -> int | None:
    """Values per top-level element of a list type: 1 for a list of scalars, the product of the sizes
    for fixed-size inner lists, None for variable inner lists (checked by the flat size instead)."""
    import pyarrow as pa

    t = list_type.value_type
    n = 1
    while pa.types.is_fixed_size_list(t):
        n *= t.list_size
        t = t.value_type
    return None if (pa.types.is_list(t) or pa.types.is_large_list(t)) else n


def _objects_to_array(arr: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """An object array of per-row arrays (what pandas gives for array columns) as one N-D array.

    The rows are concatenated by numpy in C (nested lists level by level) and the flat values
    reshaped; there is no per-row Python. Rows of the wrong size are an error, not a silent reshape.
    """
    n = len(arr)
    if n == 0:
        return np.zeros((0,) + tuple(d or 0 for d in spec.shape), dtype=np.float32)
    if not spec.shape:  # a scalar input held as Python objects (e.g. decimals): converted by the caller
        return arr
    if spec.elements is None:  # shape unknown: rows must stack as they are
        return np.stack(list(arr))
    lengths = np.frompyfunc(len, 1, 1)(arr).astype(np.int64)  # one C loop: a flat reshape would mix rows
    if lengths.min() != lengths.max():
        raise ValueError(
            f"its rows hold from {lengths.min()} to {lengths.max()} values; every row must have the same length."
        )
    flat = arr
    while flat.dtype == object and len(flat):
        flat = np.concatenate(flat)
    if flat.size != n * spec.elements:
        raise ValueError(
            f"An array column holds rows of another size than the model input expects "
            f"({spec.elements} values per row, shape {tuple(spec.shape)}): {flat.size} values "
            f"in {n} rows."
        )
    return flat.reshape((n, *spec.dims))


def _check_fits(arr: np.ndarray, dtype: np.dtype) -> None:
    """Numbers going to an integer input must fit its type: a cast would wrap an id into another one.
    Raises ValueError naming a value that does not."""
    if dtype.kind not in "iu" or arr.dtype.kind not in "iuf" or not arr.size or np.can_cast(arr.dtype, dtype):
        return
    info = np.iinfo(dtype)
    with np.errstate(invalid="ignore"):
        beyond = (arr < info.min) | (arr > info.max)
    if beyond.any():
        value = arr[beyond].flat[0].item()
        raise ValueError(
            f"it holds {value}, beyond {dtype}'s range [{info.min}, {info.max}]. Give the model input a wider "
            "integer type (keras.Input(..., dtype='int64'))."
        )


def to_model_inputs(columns: Sequence, inputs: Sequence[TensorSpec], names: Sequence[str] | None = None):
    """The arrays the model takes (inference), from pyarrow arrays or numpy / pandas column values.

    pyarrow list arrays are reshaped from their flat values; object arrays of per-row arrays
    (what pandas gives for array columns) are concatenated in C and reshaped. A row of another
    length than the input takes is an error naming the column (``names``) and the input.
    """
    import pyarrow as pa

    xs = []
    for i, (values, spec) in enumerate(zip(columns, inputs)):
        name = names[i] if names else f"#{i}"
        try:
            if spec.dtype == "string":  # Keras takes strings as a tf.string tensor, not a numpy array
                strings = column_values(values) if isinstance(values, (pa.Array, pa.ChunkedArray)) else values
                arr = np.asarray(strings, dtype=object)
                if spec.elements is not None:
                    arr = arr.reshape((len(arr), *spec.dims))
                import tensorflow as tf

                xs.append(tf.constant(arr, dtype=tf.string))
                continue
            if isinstance(values, (pa.Array, pa.ChunkedArray)):
                _check_list_rows(values, spec)
                arr = column_values(values)
            else:
                arr = np.asarray(values)
                if arr.dtype == object:
                    arr = _objects_to_array(arr, spec)
            dtype = np.dtype(spec.dtype) if spec.dtype else np.dtype(np.float32)
            _check_fits(arr, dtype)
            arr = arr.astype(dtype, copy=False)
            if spec.elements is not None:
                arr = arr.reshape((len(arr), *spec.dims))
        except ValueError as e:
            raise InvalidFeatureError(
                f"Feature column '{name}' does not fit model input '{spec.name}' (shape {tuple(spec.shape)}, "
                f"{spec.elements} values per row): {e}"
            ) from None
        xs.append(arr)
    return pack(xs, inputs, sequence=list)
