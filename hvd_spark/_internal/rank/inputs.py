"""A rank's input to ``model.fit``: its training batches (the data plan's shares, or petastorm's files),
its validation batches, horovod.spark's ``transformation_fn``, the data trace, and reader errors
raised as themselves out of ``model.fit``."""

from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.rank.epochs import data_trace
from hvd_spark._internal.rank.model import rank_seed


class source_errors:
    """Within the block, an error of the reader's Python code that reached Keras wrapped in a
    ``tf.errors.UnknownError`` is raised as itself (a ``StoreUnavailableError`` stays one)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            from hvd_spark._internal.rank.pysource import reraise_source_error

            reraise_source_error(exc)
        return False


def train_data(cfg: RunConfig, rank: int, data, seg, data_kw: dict):
    """The rank's training batches for the epochs of ``seg``: its shares of the data plan (the arrow
    reader), or its own files read endlessly (petastorm; whole epochs only)."""
    import contextlib

    from hvd_spark._internal.rank.reader import planned_dataset, rank_dataset

    if data is None:
        return rank_dataset(
            cfg.shares.train_files[rank],
            batch_size=cfg.reading.batch_size,
            shuffle=cfg.reading.shuffle,
            shuffle_buffer_size=cfg.reading.shuffle_buffer_size,
            seed=rank_seed(cfg.seed, rank),
            first_pass=seg.first,
            **data_kw,
        )
    kw = {k: v for k, v in data_kw.items() if k not in ("reader",)}
    trace = data_trace(rank, seg, data.size)
    ds = planned_dataset(
        cfg.reading.train_paths,
        data.units,
        data.epochs_of(seg, rank),
        batch_size=cfg.reading.batch_size,
        trace=trace,
        source=cfg.reading.source,
        workers=cfg.reading.reader_workers[0],
        cache=cfg.reading.cache_all,
        **kw,
    )
    return contextlib.nullcontext(ds)


def user_transformation(cfg: RunConfig):
    """horovod.spark's ``transformation_fn`` as a function of a block of rows, or None."""
    if not cfg.reading.transformation_fn:
        return None
    import cloudpickle

    from hvd_spark._internal.rank.rows import transformation

    d = cfg.data
    return transformation(cloudpickle.loads(cfg.reading.transformation_fn), d.features, d.labels, d.weight, d.inputs)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def maybe_val(cfg: RunConfig, rank: int, data_kw: dict):
    """This rank's validation rows, read once per evaluation (None: it has none; other ranks do)."""
    from hvd_spark._internal.rank.reader import rank_dataset

    if cfg.reading.val_units:
        return _planned_val(cfg, rank, data_kw)
    if not cfg.shares.val_files or not cfg.shares.val_files[rank]:
        return _NullContext()
    return rank_dataset(
        cfg.shares.val_files[rank],
        batch_size=cfg.reading.val_batch_size,
        shuffle=False,
        shuffle_buffer_size=1,
        seed=cfg.seed,
        passes=1,
        **data_kw,
    )


def val_batches(cfg: RunConfig, rank: int, size: int) -> int | None:
    """The batches of this rank's validation rows (``maybe_val``), from the row counts the driver
    planned with; None when a ``transformation_fn`` may change the rows (they are counted instead)."""
    import math

    if cfg.reading.transformation_fn:
        return None
    if cfg.reading.val_units:
        total = sum(u[2] for u in cfg.reading.val_units)
        rows = (rank + 1) * total // size - rank * total // size
    else:
        counts = dict(cfg.reading.val_table)
        mine = cfg.shares.val_files[rank] if cfg.shares.val_files and rank < len(cfg.shares.val_files) else []
        if any(path not in counts for path in mine):
            return None
        rows = sum(counts[path] for path in mine)
    return math.ceil(rows / cfg.reading.val_batch_size)


def _planned_val(cfg: RunConfig, rank: int, data_kw: dict):
    """The validation rows of a table read in place: the rows of every row group's validation side in
    stored order, cut into one contiguous share per rank (all of them: each row is evaluated once)."""
    import contextlib

    import horovod.tensorflow as hvd

    from hvd_spark._internal.common.dataplan import Unit, epoch_plan
    from hvd_spark._internal.rank.reader import planned_dataset

    size = hvd.size()
    units = [Unit(*u) for u in cfg.reading.val_units]
    plan = epoch_plan(units, 0, seed=cfg.seed, shuffle=False, window_rows=0)
    lo, hi = rank * plan.rows // size, (rank + 1) * plan.rows // size
    if hi <= lo:
        return _NullContext()
    kw = {k: v for k, v in data_kw.items() if k not in ("reader",)}
    ds = planned_dataset(
        cfg.reading.train_paths,
        units,
        lambda: iter([(plan, ((lo, hi),), hi - lo)]),
        batch_size=cfg.reading.val_batch_size,
        source=cfg.reading.source,
        side="val",
        workers=cfg.reading.reader_workers[1],
        cache=cfg.reading.cache_all,
        **kw,
    )
    return contextlib.nullcontext(ds)
