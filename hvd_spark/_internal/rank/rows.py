"""Rows of the training data as numpy: Parquet row groups read whole with pyarrow, and the rows a
rank reads in an epoch of the data plan (``common/dataplan.py``) cut into batches.

Loads neither TensorFlow nor Spark, so the fast tests read real Parquet files through it.
"""

import threading
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
    """The ``pyarrow.parquet.ParquetFile`` at ``url`` (``sources.parquet_file``: local files are read,
    not memory-mapped, so a rank's resident memory does not grow with the files it has read)."""
    import fsspec

    from hvd_spark._internal.common.sources import parquet_file

    return parquet_file(*fsspec.core.url_to_fs(url, **(storage_options or {})))


class ParquetSet:
    """The training data's Parquet files, each opened on first use (a rank reads row groups of any
    file: which ones changes every epoch, see ``common/dataplan.py``); at most ``MAX_OPEN`` stay open.

    ``source`` (a ``sources.TableSource``): the files are a table read in place. A file is checked
    against the identity the fit listed when it is opened, its columns are converted to what the copy
    would have stored, and only the rows of ``side`` (``"train"`` / ``"val"``) are kept; a row group
    holding another number of them than the plan says raises ``DataChangedError``."""

    MAX_OPEN = 64

    def __init__(
        self,
        files: Sequence[str],
        storage_options: dict | None = None,
        source=None,
        side: str = "train",
        workers: int = 1,
        cache: bool = False,
    ):
        from collections import OrderedDict

        self.files = list(files)
        self.storage_options = storage_options
        self.source, self.side = source, side
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # the open files; a file's reads are serialized by its own lock
        self._file_locks: dict[int, Any] = {}
        self._cache: dict[tuple, dict[str, np.ndarray]] | None = {} if cache else None
        self._ahead: dict[tuple, Any] = {}
        self._pool = None
        if workers > 1:
            import weakref
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hvd_spark-reader")
            weakref.finalize(self, self._pool.shutdown, wait=False)

    def prefetch(self, units, names: Sequence[str]) -> None:
        """Starts reading ``units`` in the reader threads (none: nothing), for :meth:`read` to take."""
        if self._pool is None:
            return
        for unit in units:
            key = (unit.file, unit.group, tuple(names))
            if key not in self._ahead and (self._cache is None or key not in self._cache):
                self._ahead[key] = self._pool.submit(self._read, unit, list(names))

    def drop_ahead(self) -> None:
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for f in self._open.values():
                _close(f[0] if isinstance(f, tuple) else f)
            self._open.clear()

    def _file(self, i: int):
        with self._lock:
            return self._opened(i)

    def _opened(self, i: int):
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
        while len(self._open) > self.MAX_OPEN:  # another thread may still read it: closed when released
            self._open.popitem(last=False)
        return pf

    def read(self, unit, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The columns ``names`` of a row group's rows (of this side): cached, read ahead, or read now."""
        key = (unit.file, unit.group, tuple(names))
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        ahead = self._ahead.pop(key, None)
        out = ahead.result() if ahead is not None else self._read(unit, list(names))
        if self._cache is not None:
            self._cache[key] = out
        return out

    def _read(self, unit, names: Sequence[str]) -> dict[str, np.ndarray]:
        with self._lock:
            lock = self._file_locks.setdefault(unit.file, threading.Lock())
        with lock:  # one file object is not read from two threads at once
            from hvd_spark._internal.common import retry
            from hvd_spark._internal.common.secrets import url_without_credentials

            # An object store that fails for a moment: the file is opened again and the row group read
            # again, within the store's retry window (common/retry.py), before the rank gives up.
            return retry.call(
                url_without_credentials(self.files[unit.file]),
                f"reading row group {unit.group}",
                lambda: self._read_unit(unit, names),
                on_retry=lambda _: self._forget(unit.file),
            )

    def _forget(self, i: int) -> None:
        """Closes file ``i``, so that the next read opens it again."""
        with self._lock:
            pf = self._open.pop(i, None)
        if pf is not None:
            _close(pf[0] if isinstance(pf, tuple) else pf)

    def _read_unit(self, unit, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The row group's columns; a file whose bytes do not decode raises ``DamagedFileError`` naming it
        (not retried: the next read meets the same bytes)."""
        from hvd_spark._internal.common import sources

        try:
            return self._decode_unit(unit, names)
        except Exception as e:
            if sources.undecodable(e):
                where = f"row group {unit.group}"
                raise sources.damaged_file(self.files[unit.file], where, e) from e
            raise

    def _decode_unit(self, unit, names: Sequence[str]) -> dict[str, np.ndarray]:
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


def _close(pf) -> None:
    close = getattr(pf, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - a file already gone: nothing to release
            pass


def transformation(fn, features, labels, weight, inputs=()):
    """horovod.spark's ``transformation_fn`` on a block of rows: ``fn(pandas.DataFrame) ->
    pandas.DataFrame`` sees the DataFrame's own column names (a stacked group as its scalar columns;
    array and Vector columns as one numpy array per row; a binary column as ``bytes``) and returns the
    same rows; the values come back in the stored types, but a binary column's come back decoded:
    numbers, an array of the same size per row, stacked and shaped as its model input (``inputs``, the
    specs of ``features``) takes them. Returns ``{stored: values} -> {stored: values}``."""
    import pandas as pd

    infos = list({i.stored: i for i in [*features, *labels, *([weight] if weight is not None else [])]}.values())
    specs = dict(zip([f.stored for f in features], inputs))
    decoded = {f.stored: specs.get(f.stored) for f in features if f.kind == "binary"}

    def apply(block: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(block.values())))
        frame: dict[str, Any] = {}
        for info in infos:
            values = block[info.stored].copy()  # the block may be a view of cached rows: fn may change it in place
            if info.parts:
                frame.update({p: values[:, k] for k, p in enumerate(info.parts)})
            elif values.ndim > 1:
                frame[info.name] = list(values)
            else:
                frame[info.name] = values
        out = fn(pd.DataFrame(frame))
        if not isinstance(out, pd.DataFrame) or len(out) != n:
            got = f"{len(out)} rows" if isinstance(out, pd.DataFrame) else type(out).__name__
            raise ValueError(
                f"transformation_fn must return a pandas DataFrame with the {n} rows it was given. Received: {got}."
            )
        result = {}
        for info in infos:
            if info.stored in decoded and info.name in out:
                result[info.stored] = _decoded(out[info.name], info.name, decoded[info.stored])
                continue
            old = block[info.stored]
            try:
                if info.parts:
                    new = np.stack([np.asarray(out[p]) for p in info.parts], axis=1)
                elif old.ndim > 1:
                    new = np.stack([np.asarray(v) for v in out[info.name]])
                else:
                    new = np.asarray(out[info.name])
                if old.dtype.kind in "iub" and new.dtype.kind == "f" and np.any(new != np.floor(new)):
                    raise ValueError(
                        f"it holds fractional values where the data has {old.dtype} values; cast the column to "
                        "double before fit"
                    )
                result[info.stored] = new if old.dtype == object else new.astype(old.dtype, copy=False)
            except (KeyError, ValueError) as e:
                raise ValueError(
                    f"transformation_fn's result has no usable column '{info.name}' ({e}); keep every feature, "
                    "label and weight column, with one value (or one equally long array) per row."
                ) from None
        return result

    return apply


def _decoded(values, name: str, spec) -> np.ndarray:
    """A binary column's values as ``transformation_fn`` returned them, decoded: one array of numbers
    per row (or one number), stacked, in the shape of its model input ``spec`` when that is known."""
    rows = [np.asarray(v) for v in values]
    if not rows:
        shape = tuple(spec.dims) if spec is not None and spec.elements is not None else ()
        return np.zeros((0, *shape), dtype=np.float32)
    kinds = {r.dtype.kind for r in rows}
    if not kinds <= set("biuf"):
        got = type(next(v for v, r in zip(values, rows) if r.dtype.kind not in "biuf")).__name__
        raise ValueError(
            f"transformation_fn must turn binary column '{name}' into numbers (an array per row, of the model "
            f"input's shape). Received: {got} values. Decode the bytes in transformation_fn (e.g. "
            "numpy.asarray(PIL.Image.open(io.BytesIO(b))))."
        )
    sizes = {r.size for r in rows}
    if len(sizes) > 1:
        raise ValueError(
            f"binary column '{name}' decodes to arrays of {min(sizes)} to {max(sizes)} values; every row must "
            "decode to the same size (resize the images in transformation_fn)."
        )
    stacked = np.stack(rows)
    if spec is not None and spec.elements is None and stacked.ndim != len(spec.shape) + 1:
        raise ValueError(
            f"binary column '{name}' decodes to arrays of shape {rows[0].shape}; model input '{spec.name}' takes "
            f"shape {tuple(spec.shape)} ({len(spec.shape)} dimensions per row)."
        )
    if spec is None or spec.elements is None:
        return stacked
    if rows[0].size != spec.elements:
        raise ValueError(
            f"binary column '{name}' decodes to {rows[0].size} values per row (shape {rows[0].shape}); model input "
            f"'{spec.name}' takes {spec.elements} (shape {tuple(spec.shape)})."
        )
    return stacked.reshape((len(rows), *spec.dims))


def share_rows(
    data: ParquetSet, units, plan, share: Sequence[tuple[int, int]], names: Sequence[str]
) -> Iterator[dict[str, np.ndarray]]:
    """The rows at the positions ``share`` of ``plan`` (an ``EpochPlan``), in position order, as
    {column: array} chunks. A window is read whole (its rows are permuted across its row groups) and
    only the positions asked for are kept; a window reaching over two intervals is read once."""
    import bisect

    names = list(names)
    cached: tuple[int, dict[str, np.ndarray]] | None = None

    def window(w: int, until: int) -> dict[str, np.ndarray]:
        nonlocal cached
        if cached is None or cached[0] != w:
            if w + 1 < len(plan.starts) - 1 and plan.starts[w + 1] < until:  # the share's next window: read ahead
                data.prefetch([units[u] for u in plan.window_units(w + 1)], names)
            parts = [data.read(units[u], names) for u in plan.window_units(w)]
            joined = parts[0] if len(parts) == 1 else {n: np.concatenate([p[n] for p in parts]) for n in names}
            perm = plan.window_permutation(w)
            cached = (w, joined if perm is None else {n: v[perm] for n, v in joined.items()})
        return cached[1]

    try:
        for a, b in share:
            w = bisect.bisect_right(plan.starts, a) - 1
            while a < b:
                start, end = plan.starts[w], plan.starts[w + 1]
                hi = min(b, end)
                rows = window(w, b)
                yield {n: v[a - start : hi - start] for n, v in rows.items()}
                a, w = hi, w + 1
    finally:
        data.drop_ahead()  # reads of a share left early (a fixed step count): not kept


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
