"""Rows of the training data as numpy: Parquet row groups read whole with pyarrow, and the rows a
rank reads in an epoch of the data plan (``common/dataplan.py``) cut into batches.

Loads neither TensorFlow nor Spark, so the fast tests read real Parquet files through it.
"""

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def column_values(column) -> np.ndarray:
    """A pyarrow column (Array or ChunkedArray) as numpy: scalars 1-D, fixed-length lists 2-D.

    Lists are read from their flat child values and reshaped, never row by row. Nulls were
    refused on the driver before the data was written.
    """
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(column)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        flat = column.flatten()  # respects slicing offsets
        values = flat.to_numpy(zero_copy_only=False)
        return values.reshape(n, -1) if n else values.reshape(0, 0)
    return column.to_numpy(zero_copy_only=False)


def open_parquet(url: str, storage_options: dict | None):
    import fsspec
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return pq.ParquetFile(path, memory_map=True)
    return pq.ParquetFile(fs.open(path, "rb"), pre_buffer=True)


class ParquetSet:
    """The training data's Parquet files, each opened on first use (a rank reads row groups of any
    file: which ones changes every epoch, see ``common/dataplan.py``); at most ``MAX_OPEN`` stay open.

    ``source`` (a ``sources.TableSource``): the files are a table read in place. A file is checked
    against the identity the fit listed when it is opened, its columns are converted to what the copy
    would have stored, and only the rows of ``side`` (``"train"`` / ``"val"``) are kept; a row group
    holding another number of them than the plan says raises ``DataChangedError``."""

    MAX_OPEN = 64

    def __init__(self, files: Sequence[str], storage_options: dict | None = None, source=None, side: str = "train"):
        from collections import OrderedDict

        self.files = list(files)
        self.storage_options = storage_options
        self.source, self.side = source, side
        self._open: OrderedDict[int, Any] = OrderedDict()

    def _file(self, i: int):
        pf = self._open.get(i)
        if pf is not None:
            self._open.move_to_end(i)
            return pf
        if self.source is None:
            pf = open_parquet(self.files[i], self.storage_options)
        else:
            from hvd_spark._internal.common import sources

            status = self.source.status[i] if self.source.status else None
            pf = sources.open_checked(self.files[i], self.source.storage_options, status)
            columns = [sources.resolve(pf.schema_arrow, n) for n in self.source.file_columns()]
            pf = (pf, columns, sources.group_offsets(pf.metadata))
        self._open[i] = pf
        while len(self._open) > self.MAX_OPEN:
            self._open.popitem(last=False)
        return pf

    def read(self, unit, names: Sequence[str]) -> dict[str, np.ndarray]:
        if self.source is None:
            table = self._file(unit.file).read_row_group(unit.group, columns=list(names), use_threads=True)
            return {name: column_values(table.column(name)) for name in names}
        from hvd_spark._internal.common import sources

        pf, columns, offsets = self._file(unit.file)
        url = self.files[unit.file]
        table = pf.read_row_group(unit.group, columns=columns, use_threads=True)
        mask = sources.side_mask(self.source, url, table, offsets[unit.group], self.side)
        kept = table.num_rows if mask is None else int(mask.sum())
        if kept != unit.rows:
            raise sources.DataChangedError(
                f"row group {unit.group} of {url} holds {kept} {self.side} rows now, {unit.rows} when the fit "
                "listed the table: the file changed during the fit. Fit again to train on the table as it is now."
            )
        values = sources.read_values(self.source, table, mask)
        return {name: values[name] for name in names}


def share_rows(
    data: ParquetSet, units, plan, share: Sequence[tuple[int, int]], names: Sequence[str]
) -> Iterator[dict[str, np.ndarray]]:
    """The rows at the positions ``share`` of ``plan`` (an ``EpochPlan``), in position order, as
    {column: array} chunks. A window is read whole (its rows are permuted across its row groups) and
    only the positions asked for are kept; a window reaching over two intervals is read once."""
    import bisect

    names = list(names)
    cached: tuple[int, dict[str, np.ndarray]] | None = None

    def window(w: int) -> dict[str, np.ndarray]:
        nonlocal cached
        if cached is None or cached[0] != w:
            parts = [data.read(units[u], names) for u in plan.window_units(w)]
            joined = parts[0] if len(parts) == 1 else {n: np.concatenate([p[n] for p in parts]) for n in names}
            perm = plan.window_permutation(w)
            cached = (w, joined if perm is None else {n: v[perm] for n, v in joined.items()})
        return cached[1]

    for a, b in share:
        w = bisect.bisect_right(plan.starts, a) - 1
        while a < b:
            start, end = plan.starts[w], plan.starts[w + 1]
            hi = min(b, end)
            rows = window(w)
            yield {n: v[a - start : hi - start] for n, v in rows.items()}
            a, w = hi, w + 1


def batched(chunks, batch_size: int, limit: int | None = None, group: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """``chunks`` regrouped into blocks of exactly ``group`` batches of ``batch_size`` rows (the last
    block holds what is left, which may end in a smaller batch); with ``limit``, exactly ``limit`` rows
    (``chunks`` must hold that many). The reader cuts blocks into batches in tf.data."""
    batch_size = batch_size * group
    buf: list[dict[str, np.ndarray]] = []
    held = 0
    taken = 0

    def joined():
        return buf[0] if len(buf) == 1 else {n: np.concatenate([c[n] for c in buf]) for n in buf[0]}

    for chunk in chunks:
        n = len(next(iter(chunk.values())))
        if limit is not None and taken + held + n > limit:
            chunk = {k: v[: limit - taken - held] for k, v in chunk.items()}
            n = limit - taken - held
        if n == 0:
            continue
        buf.append(chunk)
        held += n
        while held >= batch_size:
            rows = joined()
            yield {k: v[:batch_size] for k, v in rows.items()}
            buf = [{k: v[batch_size:] for k, v in rows.items()}]
            held -= batch_size
            taken += batch_size
        if limit is not None and taken + held >= limit:
            break
    if held:
        yield joined()


def epoch_batches(
    data: ParquetSet, units, epochs, names, batch_size: int, numbered: bool = False, group: int = 1
) -> Iterator:
    """The batches of several epochs, one after the other; ``epochs`` yields ``(plan, share,
    rows)`` per epoch: the rank reads ``rows`` rows from its ``share`` of ``plan``, going over the
    share again when ``rows`` is larger (a fixed ``train_steps_per_epoch``). Batches never span two
    epochs. ``numbered``: yields ``(epoch, batch)`` pairs; ``group``: blocks of that many batches
    (:func:`batched`)."""
    for plan, share, rows in epochs:
        if not share or rows <= 0:
            continue

        def cycled(plan=plan, share=share):
            while True:
                yield from share_rows(data, units, plan, share, names)

        for batch in batched(cycled(), batch_size, limit=rows, group=group):
            yield (plan.epoch, batch) if numbered else batch
