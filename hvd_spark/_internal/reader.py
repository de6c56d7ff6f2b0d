"""Worker side of the data path: a rank's Parquet files -> Petastorm -> ``tf.data``.

Never imports pyspark. Each rank reads its own files (see ``specs.assign_files``) forever
(``num_epochs=None``); the trainer takes a fixed number of steps per epoch, the same on every
rank, so uneven shards neither deadlock nor drop a rank.
"""

import contextlib
import warnings
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvd_spark._internal.specs import ColumnInfo, TensorSpec


def _target_shape(spec: TensorSpec, info: ColumnInfo, is_label: bool):
    """The per-row shape a column's values take for the model (None: leave as read)."""
    if spec.elements is None:
        return None
    n = 1 if info.kind == "scalar" else None
    if is_label and n == 1 and spec.elements != 1:
        return ()  # a class index for a multi-class output
    return tuple(spec.shape)


@contextlib.contextmanager
def rank_dataset(files: List[str], *, features: Sequence[ColumnInfo], labels: Sequence[ColumnInfo],
                 weight: Optional[ColumnInfo], inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 batch_size: int, shuffle: bool, shuffle_buffer_size: int, seed: int, workers: int = 2):
    """Yields an infinite ``tf.data.Dataset`` of ``(x, y)`` or ``(x, y, sample_weight)`` batches."""
    from petastorm import make_batch_reader
    from petastorm.tf_utils import make_petastorm_dataset

    names = list(dict.fromkeys([c.stored for c in features] + [c.stored for c in labels] +
                               ([weight.stored] if weight else [])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = make_batch_reader(list(files), schema_fields=names, num_epochs=None, shuffle_row_groups=shuffle,
                                   seed=seed, workers_count=workers, reader_pool_type="thread")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = make_petastorm_dataset(reader)
        # Petastorm yields whole row groups; everything below works on those batches (no per-row
        # tf.data work), then rebatch cuts them into training batches.
        in_shapes = [_target_shape(s, c, False) for s, c in zip(inputs, features)]
        out_shapes = [_target_shape(s, c, True) for s, c in zip(outputs, labels)]
        in_types = [tf.as_dtype(s.dtype) if s.dtype else tf.float32 for s in inputs]

        def shaped(v, shape):
            return tf.reshape(v, [-1, *shape]) if shape is not None else v

        def convert(batch):
            columns = {name: getattr(batch, name) for name in names}
            if shuffle:  # rows within the row group; row groups themselves come in shuffled order
                order = tf.random.shuffle(tf.range(tf.shape(columns[names[0]])[0]), seed=seed)
                columns = {k: tf.gather(v, order) for k, v in columns.items()}
            xs = [shaped(tf.cast(columns[c.stored], dt), shape) for c, shape, dt in zip(features, in_shapes, in_types)]
            ys = [shaped(tf.cast(columns[c.stored], tf.int32 if c.is_integer else tf.float32), shape)
                  for c, shape in zip(labels, out_shapes)]
            x = xs[0] if len(xs) == 1 else tuple(xs)
            y = ys[0] if len(ys) == 1 else tuple(ys)
            if weight is not None:
                return x, y, tf.cast(columns[weight.stored], tf.float32)
            return x, y

        ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE).rebatch(batch_size, drop_remainder=False)
        if shuffle:
            ds = ds.shuffle(max(1, shuffle_buffer_size // batch_size), seed=seed, reshuffle_each_iteration=True)
        yield ds.prefetch(tf.data.AUTOTUNE)
    finally:
        reader.stop()
        reader.join()


def to_model_inputs(columns: Sequence[np.ndarray], inputs: Sequence[TensorSpec]):
    """Stacks pandas / Arrow column values into the arrays the model takes (inference)."""
    xs = []
    for values, spec in zip(columns, inputs):
        arr = np.asarray(values)
        if arr.dtype == object:
            arr = np.stack([np.asarray(v) for v in values]) if len(values) else np.zeros((0,) + tuple(
                d or 0 for d in spec.shape))
        dtype = np.dtype(spec.dtype) if spec.dtype else np.float32
        arr = arr.astype(dtype, copy=False)
        if spec.elements is not None:
            arr = arr.reshape((len(arr),) + tuple(spec.shape))
        xs.append(arr)
    return xs[0] if len(xs) == 1 else xs
