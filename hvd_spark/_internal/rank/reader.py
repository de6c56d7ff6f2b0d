"""Worker side of the data path: a rank's Parquet files -> ``tf.data``.

Never imports pyspark. Two sources feed the same pipeline:

* ``"arrow"`` (default): pyarrow reads whole row groups; list columns become N-D arrays from
  their flat values (no per-row Python); each pass over the data visits the row groups in a new
  order and permutes rows within windows of ``shuffle_buffer_size`` rows (whole row groups), with
  a seed per rank and per pass: every pass holds every row once. Works with any pyarrow >= 12 and
  reads local paths directly and other stores through fsspec.
* ``"petastorm"``: Petastorm's ``make_batch_reader`` (needs pyarrow 12; kept for the old line).

Each rank reads its own files (see ``specs.assign_files``) forever; the trainer takes a fixed
number of steps per epoch, the same on every rank, so uneven shards neither deadlock nor drop a rank.
"""

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from hvd_spark._internal.common.choices import READERS
from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec, pack
from hvd_spark._internal.rank.model_inputs import to_model_inputs  # noqa: F401  # its old home: tests import it here
from hvd_spark._internal.rank.pysource import python_source
from hvd_spark._internal.rank.rows import ParquetSet, column_values, epoch_batches, open_parquet


def petastorm_available() -> bool:
    """Whether Petastorm imports here (it does not with pyarrow >= 13)."""
    try:
        import petastorm.reader  # noqa: F401

        return True
    except Exception:  # ImportError, or pyarrow's missing pyarrow.filesystem: not usable either way
        return False


def check_reader(reader: str) -> None:
    """Raises ValueError on the driver when ``reader`` is unknown or cannot run with this pyarrow."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {list(READERS)}. Received: reader={reader!r}.")
    if reader == "petastorm" and not petastorm_available():
        import pyarrow

        raise ValueError(
            f"reader='petastorm' needs Petastorm 0.13.1 with pyarrow 12; this environment has pyarrow "
            f"{pyarrow.__version__}{'' if _has_module('petastorm') else ' and no petastorm'}. Use "
            "reader='arrow' (the default), or install hvd_spark[petastorm] on the Spark 3.5 line."
        )


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _target_shape(spec: TensorSpec, info: ColumnInfo, is_label: bool):
    """The per-row shape a column's values take for the model (None: leave as read)."""
    if spec.elements is None:
        return None
    n = 1 if info.kind == "scalar" else None
    if is_label and n == 1 and spec.elements != 1:
        return ()  # a class index for a multi-class output
    return tuple(spec.shape)


def arrow_batches(
    files: Sequence[str],
    names: Sequence[str],
    *,
    shuffle: bool,
    seed: int,
    storage_options: dict | None = None,
    passes: int | None = None,
    window_rows: int = 0,
    first_pass: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields the rows of ``files`` as {column: array} chunks, ``passes`` times (None: forever); each
    pass holds every row exactly once.

    With ``shuffle``, each pass visits the row groups in a new order and permutes rows within windows
    of consecutive row groups holding at least ``window_rows`` rows (0: within each row group), so
    rows of different row groups share batches; the generator is seeded with ``seed`` and the pass
    number, so ranks (which get different seeds) and passes differ, and a rerun with the same seed
    repeats exactly. A window never spans two passes. ``first_pass`` numbers the first pass (a resumed
    run starts at its epoch, so it does not replay the first epochs' order).
    """
    parquet = [open_parquet(f, storage_options) for f in files]
    units = [
        (i, g)
        for i, pf in enumerate(parquet)
        for g in range(pf.num_row_groups)
        if pf.metadata.row_group(g).num_rows > 0
    ]
    if not units:
        raise ValueError(f"The Parquet files {list(files)} hold no rows.")
    names = list(names)
    n_pass = 0
    while passes is None or n_pass < passes:
        rng = np.random.default_rng([seed, first_pass + n_pass])
        order = rng.permutation(len(units)) if shuffle else range(len(units))
        window: list[dict[str, np.ndarray]] = []
        held = 0
        for k, u in enumerate(order):
            i, g = units[u]
            table = parquet[i].read_row_group(g, columns=names, use_threads=True)
            chunk = {name: column_values(table.column(name)) for name in names}
            if not shuffle:
                yield chunk
                continue
            window.append(chunk)
            held += table.num_rows
            if held >= window_rows or k == len(units) - 1:
                joined = window[0] if len(window) == 1 else {n: np.concatenate([c[n] for c in window]) for n in names}
                perm = rng.permutation(held)
                yield {n: v[perm] for n, v in joined.items()}
                window, held = [], 0
        n_pass += 1


def _arrow_signature(files: Sequence[str], names: Sequence[str], storage_options: dict | None):
    """tf.TensorSpecs of the row-group batches, from the first file's Parquet schema."""
    import pyarrow as pa

    schema = open_parquet(files[0], storage_options).schema_arrow
    sig = {}
    for name in names:
        t = schema.field(name).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
        value_type = t.value_type if is_list else t
        strings = pa.types.is_string(value_type) or pa.types.is_large_string(value_type)
        strings = strings or pa.types.is_binary(value_type) or pa.types.is_large_binary(value_type)
        sig[name] = tf.TensorSpec(
            shape=(None, None) if is_list else (None,),
            dtype=tf.string if strings else tf.as_dtype(value_type.to_pandas_dtype()),
        )
    return sig


def _decoded_specs(features: Sequence[ColumnInfo], inputs: Sequence[TensorSpec]) -> dict:
    """tf.TensorSpecs of the binary feature columns once ``transformation_fn`` decoded them (see
    ``rows.transformation``): their model input's shape and type, where the file holds bytes."""
    return {
        c.stored: tf.TensorSpec(shape=(None, *spec.shape), dtype=tf.as_dtype(spec.dtype or "float32"))
        for c, spec in zip(features, inputs)
        if c.kind == "binary"
    }


@contextlib.contextmanager
def _arrow_source(
    files,
    names,
    shuffle,
    seed,
    storage_options,
    passes=None,
    window_rows=0,
    first_pass=0,
    transformation=None,
    decoded=None,
):
    files = list(files)
    sig = dict(_arrow_signature(files, names, storage_options), **(decoded or {}))

    def chunks():
        read = arrow_batches(
            files,
            names,
            shuffle=shuffle,
            seed=seed,
            storage_options=storage_options,
            passes=passes,
            window_rows=window_rows,
            first_pass=first_pass,
        )
        return read if transformation is None else map(transformation, read)

    ds = python_source(chunks, sig)
    yield ds.prefetch(2)  # the next row groups are read while the current ones train


@contextlib.contextmanager
def _petastorm_source(files, names, shuffle, seed, workers, passes=None):
    from petastorm import make_batch_reader
    from petastorm.tf_utils import make_petastorm_dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = make_batch_reader(
            list(files),
            schema_fields=list(names),
            num_epochs=passes,
            shuffle_row_groups=shuffle,
            seed=seed,
            workers_count=workers,
            reader_pool_type="thread",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = make_petastorm_dataset(reader)
        ds = ds.map(lambda batch: {name: getattr(batch, name) for name in names})
        if shuffle:  # rows within the row group; row groups themselves come in shuffled order
            ds = ds.map(lambda cols: _shuffle_rows(cols, names[0], seed))
        yield ds
    finally:
        reader.stop()
        reader.join()


def _shuffle_rows(columns, first: str, seed: int):
    order = tf.random.shuffle(tf.range(tf.shape(columns[first])[0]), seed=seed)
    return {k: tf.gather(v, order) for k, v in columns.items()}


@contextlib.contextmanager
def rank_dataset(
    files: list[str],
    *,
    features: Sequence[ColumnInfo],
    labels: Sequence[ColumnInfo],
    weight: ColumnInfo | None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    batch_size: int,
    shuffle: bool,
    shuffle_buffer_size: int,
    seed: int,
    reader: str = "arrow",
    storage_options: dict | None = None,
    workers: int = 2,
    passes: int | None = None,
    first_pass: int = 0,
    label_shapes=None,
    transformation=None,
    prefetch: int = 0,
):
    """Yields a ``tf.data.Dataset`` of ``(x, y)`` or ``(x, y, sample_weight)`` batches: endless, or
    ``passes`` passes over the files (validation: one, so that each row counts once)."""
    names = _column_names(features, labels, weight)
    if reader == "petastorm":
        source = _petastorm_source(files, names, shuffle, seed, workers, passes)
    elif reader == "arrow":
        source = _arrow_source(
            files,
            names,
            shuffle,
            seed,
            storage_options,
            passes,
            shuffle_buffer_size,
            first_pass,
            transformation,
            _decoded_specs(features, inputs),
        )
    else:
        raise ValueError(f"reader must be one of {list(READERS)}. Received: reader={reader!r}.")
    with source as ds:
        # Whole row groups go through the conversion below (no per-row tf.data work); rebatch then
        # cuts them into training batches.
        convert = _converter(features, labels, weight, inputs, outputs, label_shapes)
        ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE).rebatch(batch_size, drop_remainder=False)
        if shuffle and reader == "petastorm":
            # Petastorm yields row groups whole: a buffer of batches mixes them (it spans passes). The
            # arrow reader mixes rows across row groups itself, within each pass (shuffle_buffer_size rows).
            ds = ds.shuffle(max(1, shuffle_buffer_size // batch_size), seed=seed, reshuffle_each_iteration=True)
        yield without_autotune_model(ds.prefetch(prefetch or tf.data.AUTOTUNE))


def without_autotune_model(ds: "tf.data.Dataset") -> "tf.data.Dataset":
    """``ds`` without tf.data's autotuning model: every dataset a rank trains or validates on.

    The model runs a thread per iterator that sleeps between optimizations, its period doubling from
    10 ms to 60 s. Keras destroys the iterator as ``model.fit`` returns, and the destructor joins
    that thread; in a rank's process the join does not cut the sleep short but waits it out, so a
    rank that trained 40-80 s stayed in ``model.fit`` up to 40 s after its last epoch, every thread
    idle, and the fit with it (issue 38's idle tail; the stack: ``~RootDataset::Iterator`` ->
    ``~LogicalThreadWrapper`` while the thread sleeps in ``Model::OptimizeLoop``). Without the
    model there is no such thread. The reader sizes its own work (row groups read ahead by its
    threads, blocks of whole batches); prefetch buffers still grow with TF's per-buffer autotuner,
    and parallel maps run at TF's default parallelism."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def _column_names(features, labels, weight) -> list[str]:
    return list(
        dict.fromkeys([c.stored for c in features] + [c.stored for c in labels] + ([weight.stored] if weight else []))
    )


def _converter(features, labels, weight, inputs, outputs, label_shapes=None):
    """{column: values} -> ``(x, y)`` or ``(x, y, sample_weight)`` in the model's shapes and types;
    ``label_shapes`` (horovod.spark's) gives the labels' shapes instead of the outputs'."""
    in_shapes = [_target_shape(s, c, False) for s, c in zip(inputs, features)]
    out_shapes = [_target_shape(s, c, True) for s, c in zip(outputs, labels)]
    if label_shapes:  # horovod.spark's, or a sparse loss's per-step class indices; None: the output's
        out_shapes = [tuple(s) if s is not None else d for s, d in zip(label_shapes, out_shapes)]
    in_types = [tf.as_dtype(s.dtype) if s.dtype else tf.float32 for s in inputs]

    def shaped(v, shape):
        return tf.reshape(v, [-1, *shape]) if shape is not None else v

    def convert(columns):
        xs = [shaped(tf.cast(columns[c.stored], dt), shape) for c, shape, dt in zip(features, in_shapes, in_types)]
        ys = [
            shaped(tf.cast(columns[c.stored], tf.int32 if c.is_integer else tf.float32), shape)
            for c, shape in zip(labels, out_shapes)
        ]
        x, y = pack(xs, inputs), pack(ys, outputs)  # dicts for a model built on dicts
        if weight is not None:
            return x, y, tf.cast(columns[weight.stored], tf.float32)
        return x, y

    return _not_converted(convert)


def _not_converted(fn):
    """``fn`` for ``tf.data``'s ``map``, traced as it is: AutoGraph would rewrite its source (and that
    of what it calls) first, about 0.3 s of every rank's start, for functions whose only control
    flow is over the columns' static structure."""
    return tf.autograph.experimental.do_not_convert(fn)


BLOCK_ROWS = 8192  # rows per block of whole batches handed from the reader's Python to tf.data


def planned_dataset(
    files: Sequence[str],
    units,
    epochs,
    *,
    features: Sequence[ColumnInfo],
    labels: Sequence[ColumnInfo],
    weight: ColumnInfo | None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    batch_size: int,
    storage_options: dict | None = None,
    trace: "Callable[[int, int, dict], None] | None" = None,
    source=None,
    side: str = "train",
    label_shapes=None,
    transformation=None,
    prefetch: int = 0,
    workers: int = 2,
    cache: bool = False,
) -> "tf.data.Dataset":
    """The training batches of a rank for the epochs ``epochs()`` yields (``(plan, share, rows)``
    each, see :func:`epoch_batches`; called anew for each pass of the dataset), as a
    ``tf.data.Dataset`` of ``(x, y)`` or ``(x, y, sample_weight)``.

    ``trace``: called as ``trace(epoch, batch number in the epoch, batch)`` for every batch read
    (``HVD_SPARK_DATA_TRACE``). ``source`` (a ``sources.TableSource``): ``files`` are a table read in
    place, of which the rows of ``side`` are read. ``transformation``: applied to each block of rows
    ({column: values} -> the same); ``prefetch``: batches prepared ahead (0: AUTOTUNE); ``workers``:
    threads reading the next window's row groups ahead (1: none); ``cache``: keep every row group read."""
    names = _column_names(features, labels, weight)
    sig = _arrow_signature(files, names, storage_options) if source is None else _source_signature(source, names)
    sig.update(_decoded_specs(features, inputs))
    data = ParquetSet(files, storage_options, source=source, side=side, workers=workers, cache=cache)

    group = max(1, BLOCK_ROWS // batch_size)  # batches per block crossing from Python to tf.data

    def gen():
        epoch, step = None, 0
        for e, block in epoch_batches(data, units, epochs(), names, batch_size, numbered=True, group=group):
            if e != epoch:
                epoch, step = e, 0
            if transformation is not None:
                block = transformation(block)
            n = len(next(iter(block.values())))
            for start in range(0, n, batch_size):
                if trace is not None:
                    trace(e, step, {k: v[start : start + batch_size] for k, v in block.items()})
                step += 1
            yield block

    ds = python_source(gen, sig)
    convert = _converter(features, labels, weight, inputs, outputs, label_shapes)

    def batches(*block):  # a block is whole batches and, at an epoch's end, a smaller last one
        return sliced(block if len(block) > 1 else block[0], batch_size)

    ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE).flat_map(_not_converted(batches))
    return without_autotune_model(ds.prefetch(prefetch or tf.data.AUTOTUNE))


def sliced(block, batch_size: int) -> "tf.data.Dataset":
    """The batches of ``block`` (a structure of tensors of the same rows): consecutive slices of
    ``batch_size`` rows, the last one smaller when the rows do not divide. One slice per batch (not
    ``from_tensor_slices(block).batch``, which goes through every row: 3x the CPU of the whole read,
    taken from the training step's threads)."""
    n = tf.shape(tf.nest.flatten(block)[0], out_type=tf.int64)[0]
    size = tf.constant(batch_size, tf.int64)

    def take(i):
        lo = i * size
        hi = tf.minimum(lo + size, n)
        return tf.nest.map_structure(lambda t: t[lo:hi], block)

    return tf.data.Dataset.range((n + size - 1) // size).map(_not_converted(take))


def _source_signature(source, names: Sequence[str]) -> dict:
    """tf.TensorSpecs of the blocks of a table read in place: what its columns convert to."""
    by_name = {c.stored: c for c in source.columns}
    return {
        n: tf.TensorSpec(
            shape=(None,) if by_name[n].kind == "scalar" else (None, None),
            dtype=tf.string if by_name[n].dtype in ("string", "binary") else tf.as_dtype(by_name[n].dtype),
        )
        for n in names
    }
