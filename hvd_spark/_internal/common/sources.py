"""A table's own Parquet files read in place: which file columns feed which model columns and how
they become the arrays the copied path would have stored, which rows of a row group belong to the
validation split, the statistics of a row group, and each file's identity (size, modification time).

Pure pyarrow / numpy / fsspec: the driver's scan (``data/inplace.py``, in Spark tasks) and every
rank's reader (``rank/rows.py``) run the same functions, so both see the same rows, the same split
and the same values. Loads neither Spark nor TensorFlow.
"""

import hashlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SIDES = ("train", "val")


from hvd_spark.errors import DamagedFileError, DataChangedError  # noqa: E402 - raised by ranks and the driver's checks


@dataclass(frozen=True)
class SourceColumn:
    """One column the rank reads, built from the file's own columns.

    ``kind``: ``"scalar"`` (one file column), ``"array"`` (a list column), ``"vector"`` (Spark ML's
    Vector struct: ``type``, ``size``, ``indices``, ``values``), ``"group"`` (scalar file columns
    stacked in order). ``dtype`` is the numpy type of the values as the copied path stores them, so
    both paths give the model the same numbers."""

    stored: str
    kind: str
    names: tuple[str, ...]
    dtype: str
    label: str = ""  # the DataFrame column (or group) it comes from, for messages and statistics


@dataclass(frozen=True)
class TableSource:
    """How a fit reads a table in place: the columns, the validation split and each file's identity.

    ``split``: ``()`` (no validation), ``("fraction", f, seed)`` (a row is a validation row when the
    hash of its file name and its row number in the file, seeded, is below ``f``) or
    ``("column", name)`` (the file column ``name`` is true / 1) or ``("files", urls)`` (the rows of
    these files). The file's name in the hash is its path below ``root`` (partition folders hold
    files of the same name), its base name for a file elsewhere."""

    columns: tuple[SourceColumn, ...]
    split: tuple = ()
    status: tuple[tuple[int, int], ...] = ()  # (bytes, modification time in ms) per file, in file order
    storage_options: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    root: str = ""  # the table's folder: the split hashes a file's path below it

    def file_columns(self) -> list[str]:
        names = [n for c in self.columns for n in c.names]
        if self.split and self.split[0] == "column":
            names.append(self.split[1])
        return list(dict.fromkeys(names))


# --- types: what the copy stores for a Spark type ------------------------------------------------

_SPARK_NUMPY = {
    "tinyint": "int8",
    "smallint": "int16",
    "int": "int32",
    "bigint": "int64",
    "float": "float32",
    "double": "float64",
    "boolean": "int32",
}


OBJECT_DTYPES = ("string", "binary")  # values read as Python objects (str, bytes): only their nulls are checked


def stored_dtype(kind: str, element_type: str, is_integer: bool) -> str:
    """The numpy type the copied path stores a column in (``materialize._as_stored``): Vectors as
    float32 arrays, arrays and stacked scalars as int64 when their elements (or one of the stacked
    columns) are ``bigint``, so that 64-bit ids stay whole, as int32 for other integers, float32
    otherwise; booleans as int32, decimals as float64, other scalars as their own type. (For a group,
    ``element_type`` is ``materialize._group_info``'s: ``bigint``, ``int`` or ``float``.)"""
    if element_type in OBJECT_DTYPES:
        return element_type  # object arrays of str or bytes (bytes: decoded by transformation_fn)
    if kind in ("vector",):
        return "float32"
    if kind in ("array", "group"):
        return ("int64" if element_type == "bigint" else "int32") if is_integer else "float32"
    if element_type.startswith("decimal"):
        return "float64"
    return _SPARK_NUMPY.get(element_type, "float64")


# --- files ---------------------------------------------------------------------------------------


def file_system(url: str, storage_options: dict | None):
    """``(fsspec filesystem, path)`` of ``url``; Hadoop's ``s3a://`` / ``s3n://`` are read as ``s3://``."""
    import fsspec

    for hadoop in ("s3a://", "s3n://"):
        if url.startswith(hadoop):
            url = "s3://" + url[len(hadoop) :]
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def file_status(url: str, storage_options: dict | None) -> tuple[int, int]:
    """(bytes, modification time in ms) of the file at ``url`` (0 for a time the filesystem lacks);
    retried on transient errors (``common/retry.py``)."""
    from hvd_spark._internal.common import retry
    from hvd_spark._internal.common.secrets import url_without_credentials

    fs, path = file_system(url, storage_options)

    def info_now() -> Any:
        fs.invalidate_cache(path)  # object stores' listings are cached: a changed file must be seen
        return fs.info(path)

    info = retry.call(url_without_credentials(url), "reading the file's size and time", info_now)
    when = info.get("mtime", info.get("LastModified", info.get("last_modified", info.get("updated"))))
    if hasattr(when, "timestamp"):
        ms = int(when.timestamp() * 1000)
    elif when is None:
        ms = 0
    else:
        ms = int(float(when) * 1000)
    return int(info["size"]), ms


def open_checked(url: str, storage_options: dict | None, expected: tuple[int, int] | None):
    """The ``pyarrow.parquet.ParquetFile`` at ``url``, after checking that it is still the file the fit
    listed (``expected``: bytes and modification time); raises :class:`DataChangedError` otherwise."""
    try:
        now = file_status(url, storage_options)
    except FileNotFoundError:
        raise DataChangedError(
            f"{url} was removed after the fit listed the table's files (was the table overwritten?). "
            "Fit again to train on the table as it is now."
        ) from None
    if expected is not None and tuple(expected) != now:
        raise DataChangedError(
            f"{url} changed after the fit listed the table's files: {expected[0]} bytes modified at "
            f"{expected[1]} ms then, {now[0]} bytes modified at {now[1]} ms now. Fit again to train on the "
            "table as it is now."
        )
    return parquet_file(*file_system(url, storage_options))


def undecodable(error: BaseException) -> bool:
    """Whether ``error``, raised by pyarrow's Parquet reader, says that the file's bytes do not decode
    (garbage in a page or the footer: a bare ``OSError`` such as "Corrupt snappy compressed data" or
    "Couldn't deserialize thrift", or an ``ArrowInvalid``), not that they could not be fetched (a
    transient fault, a missing file: ``common/retry.py``'s rules)."""
    from hvd_spark._internal.common import retry

    if isinstance(error, (DataChangedError, DamagedFileError)) or retry.is_transient(error):
        return False
    if type(error) is OSError and error.errno is None:
        return True
    return any(c.__name__ in ("ArrowInvalid", "ArrowSerializationError") for c in type(error).__mro__)


def damaged_file(url: str, where: str, error: BaseException) -> DamagedFileError:
    """The error of a file that does not decode (:func:`undecodable`): one short line naming the file
    (without credentials) and ``where`` in it (``"row group 3"``), the reader's error, what to do."""
    from hvd_spark._internal.common.secrets import url_without_credentials

    cause = "".join(c if c.isprintable() else " " for c in " ".join(str(error).split()))[:200].strip().rstrip(".")
    return DamagedFileError(
        f"{url_without_credentials(url)} ({where}) cannot be decoded: {type(error).__name__}: {cause}. The file is "
        "damaged or was written badly (its size and modification time do not show it): rewrite it (or remove it "
        "from the table) and fit again."
    )


def parquet_file(fs, path: str):
    """The ``pyarrow.parquet.ParquetFile`` at ``path`` of the fsspec filesystem ``fs``.

    A local file is read with plain reads into buffers that are freed once a row group is converted,
    never memory-mapped: the pages of a mapped file count in the reading process's resident memory
    (RSS) for as long as the file stays open, so a rank reading a table in place (up to
    ``ParquetSet.MAX_OPEN`` files open) grew with the table, 690 MiB at 1M rows to 1.9 GiB at 20M, and
    YARN's and container monitors' memory checks count RSS. Read, the pages stay in the kernel's page
    cache, which is no process's RSS. And without ``pre_buffer`` (on by default in pyarrow): its cache keeps
    the last row group read of each open file, so the rank's memory grew with its open files instead
    (16 MiB each on a table of 17 MiB row groups). Other filesystems: through fsspec, a row group's
    column chunks fetched together (``pre_buffer``: fewer, coalesced requests; the last row group's
    chunks stay cached while the file is open, at most ``ParquetSet.MAX_OPEN`` files)."""
    import pyarrow.parquet as pq

    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return pq.ParquetFile(path, memory_map=False, pre_buffer=False)
    return pq.ParquetFile(fs.open(path, "rb"), pre_buffer=True)


def resolve(schema, name: str) -> str:
    """The file's own spelling of column ``name``: exact, else the one column equal ignoring case
    (Spark resolves Parquet columns that way). KeyError when the file has none."""
    names = schema.names
    if name in names:
        return name
    folded = [n for n in names if n.lower() == name.lower()]
    if len(folded) == 1:
        return folded[0]
    raise KeyError(name)


# --- the validation split ------------------------------------------------------------------------


def _uniform(key: str, start: int, n: int, seed: int) -> np.ndarray:
    """A value in [0, 1) per row ``start .. start + n - 1`` of the file named ``key``: splitmix64 of the
    row number offset by a hash of the file name and the seed. The same on every machine and run."""
    k = int.from_bytes(hashlib.blake2b(f"{int(seed)}:{key}".encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        x = np.arange(start, start + n, dtype=np.uint64) + np.uint64(k)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def split_mask(source: TableSource, url: str, table, first_row: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(validation mask, invalid mask)`` of the rows of ``table`` (a row group whose first row is row
    ``first_row`` of its file): None for a fit without validation; the invalid mask (a validation
    column's nulls and values other than 0 / 1 / true / false) is None when there are none."""
    if not source.split:
        return None, None
    n = table.num_rows
    if source.split[0] == "files":  # fit_on_parquet's validation_path: these files are the validation rows
        return np.full(n, url in source.split[1], dtype=bool), None
    if source.split[0] == "fraction":
        _, fraction, seed = source.split
        return _uniform(split_key(source.root, url), first_row, n, seed) < float(fraction), None
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(resolve(table.schema, source.split[1]))
    if pa.types.is_boolean(column.type):
        valid = pc.is_valid(column)
        flag = pc.fill_null(column, False)
    else:
        values = pc.cast(column, pa.float64())
        valid = pc.and_kleene(pc.is_valid(values), pc.or_(pc.equal(values, 1.0), pc.equal(values, 0.0)))
        flag = pc.fill_null(pc.equal(values, 1.0), False)
    bad = ~_np_bool(valid)
    return _np_bool(flag), (bad if bad.any() else None)


def _path_part(url: str) -> str:
    """``url`` without its scheme (``s3a://b/t`` and ``s3://b/t`` are one path, ``file:/x`` and
    ``file:///x`` too)."""
    import urllib.parse

    u = urllib.parse.urlparse(url)
    return u.netloc + u.path if u.scheme else url


def split_key(root: str, url: str) -> str:
    """The name a file has in the split's hash: its path below the table's folder ``root``, else its
    base name."""
    if root:
        base, path = _path_part(root).rstrip("/") + "/", _path_part(url)
        if path.startswith(base):
            return path[len(base) :]
    return posixpath.basename(url)


def _np_bool(column) -> np.ndarray:
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.fill_null(False).to_numpy(zero_copy_only=False).astype(bool)


def side_mask(source: TableSource, url: str, table, first_row: int, side: str) -> np.ndarray | None:
    """The rows of ``side`` (``"train"`` / ``"val"``) in a row group; None: every row (no split)."""
    val, _ = split_mask(source, url, table, first_row)
    if val is None:
        return None if side == "train" else np.zeros(table.num_rows, dtype=bool)
    return val if side == "val" else ~val


# --- values --------------------------------------------------------------------------------------


def _array(column):
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _flat_values(column) -> tuple[np.ndarray, np.ndarray]:
    """(flat element values, elements per row) of a list column (null rows hold none)."""
    import pyarrow.compute as pc

    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return column.flatten().to_numpy(zero_copy_only=False), lengths


def _vector_values(column) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Spark ML Vector column (struct of type, size, indices, values) as ``(rows, cols, values)`` of
    its non-zero entries, plus its width per row (dense: its values; sparse: its size)."""
    import pyarrow.compute as pc

    n = len(column)
    kind = pc.fill_null(column.field("type"), 1).to_numpy(zero_copy_only=False).astype(np.int8)
    values, lengths = _flat_values(column.field("values"))
    sizes = pc.fill_null(column.field("size"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    width = np.where(kind == 1, lengths, sizes)
    rows = np.repeat(np.arange(n), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    cols = np.arange(len(values)) - np.repeat(starts, lengths)
    sparse = kind[rows] != 1
    if sparse.any():
        cols[sparse] = column.field("indices").flatten().to_numpy(zero_copy_only=False)
    return np.stack([rows, cols]), values, width


def values_of(col: SourceColumn, table) -> np.ndarray:
    """The column's values as the copied path stores them: 1-D for scalars, 2-D ``(rows, width)``
    otherwise. Nulls must have been refused by the statistics (:func:`row_group_stats`)."""
    dtype = np.dtype(object if col.dtype in OBJECT_DTYPES else col.dtype)
    if col.kind == "group":
        parts = [_scalar(_array(table.column(resolve(table.schema, n)))) for n in col.names]
        return np.stack(parts, axis=1).astype(dtype, copy=False) if parts else np.zeros((table.num_rows, 0), dtype)
    column = _array(table.column(resolve(table.schema, col.names[0])))
    n = len(column)
    if col.kind == "scalar" and col.dtype in OBJECT_DTYPES:
        return column.to_numpy(zero_copy_only=False)
    if col.kind == "scalar":
        return _scalar(column).astype(dtype, copy=False)
    if col.kind == "array":
        flat, lengths = _flat_values(column)
        width = int(lengths[0]) if n else 0
        return flat.astype(dtype, copy=False).reshape(n, width)
    (rows, cols), values, widths = _vector_values(column)
    out = np.zeros((n, int(widths.max()) if n else 0), dtype=dtype)
    out[rows, cols] = values
    return out


def _scalar(column) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_decimal(column.type):
        column = column.cast(pa.float64())
    return column.to_numpy(zero_copy_only=False)


def read_values(source: TableSource, table, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """{stored name: values} of the rows of ``table`` where ``mask`` holds (None: all)."""
    out = {}
    for col in source.columns:
        v = values_of(col, table)
        out[col.stored] = v if mask is None else v[mask]
    return out


# --- statistics of a row group (the same fields as data/stats.py computes with Spark) -------------


def _numbers(array) -> np.ndarray:
    """A flat pyarrow array of numbers as numpy in its own type, nulls as 0 (they are counted apart)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_decimal(array.type):
        array = array.cast(pa.float64())
    if array.null_count:
        array = pc.fill_null(array, False if pa.types.is_boolean(array.type) else 0)
    return array.to_numpy(zero_copy_only=False)


def _checked_rows(col: SourceColumn, table) -> tuple[np.ndarray, np.ndarray, Any]:
    """``(bad, overflow, value)``: the rows with a null, NaN or infinity anywhere in the column (for a
    group: in any of its columns; a float64 beyond float32's largest value where the copy stores
    float32 too: it would become infinite, as in the copy), and the other rows with a value beyond the
    range of the integer type the DataFrame casts the column to (Spark's ANSI cast refuses those;
    numpy's would wrap them), with one such value as the file holds it (None: no such row)."""
    import pyarrow.compute as pc

    bad = np.zeros(table.num_rows, dtype=bool)
    over = np.zeros(table.num_rows, dtype=bool)
    example = None
    target = None if col.dtype in OBJECT_DTYPES else np.dtype(col.dtype)
    for name in col.names:
        column = _array(table.column(resolve(table.schema, name)))
        bad |= ~_np_bool(pc.is_valid(column))
        if target is None:
            continue
        parents = None  # scalars: an element is a row
        flat = column
        if col.kind not in ("scalar", "group"):
            lists = column.field("values") if col.kind == "vector" else column
            flat = lists.flatten()
            if not len(flat):
                continue
            parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
        elem_bad = ~_np_bool(pc.is_valid(flat))
        values = _numbers(flat)
        if values.dtype.kind == "f":
            elem_bad |= ~np.isfinite(values)
            if target.kind == "f" and target.itemsize < values.dtype.itemsize:
                with np.errstate(invalid="ignore"):
                    elem_bad |= np.abs(values) > np.finfo(target).max
        elem_over = None
        if target.kind in "iu" and values.dtype.kind in "iuf" and not np.can_cast(values.dtype, target):
            info = np.iinfo(target)
            with np.errstate(invalid="ignore"):
                elem_over = ~elem_bad & ((values < info.min) | (values > info.max))
            if elem_over.any():
                example = values[elem_over][0].item() if example is None else example
            else:
                elem_over = None
        if parents is None:
            bad |= elem_bad
            if elem_over is not None:
                over |= elem_over
            continue
        bad[np.unique(parents[elem_bad])] = True
        if elem_over is not None:
            over[np.unique(parents[elem_over])] = True
    return bad, over & ~bad, example


def _element_range(col: SourceColumn, table) -> tuple[Any, Any]:
    """(smallest, largest) value the model gets from an array, Vector or group column (a sparse
    Vector's implicit zeros included), after the copy's conversion; (None, None) for no values."""
    if col.kind == "group":
        flat = values_of(col, table).reshape(-1)
    elif col.kind == "array":
        flat = _flat_values(_array(table.column(resolve(table.schema, col.names[0]))))[0].astype(col.dtype)
    else:
        _, values, widths = _vector_values(_array(table.column(resolve(table.schema, col.names[0]))))
        flat = values.astype(col.dtype)
        if len(flat) < int(widths.sum()):
            flat = np.append(flat, np.zeros(1, flat.dtype))
    if not len(flat):
        return None, None
    return flat.min().item(), flat.max().item()


def row_group_stats(source: TableSource, url: str, table, first_row: int) -> dict:
    """The statistics of one row group in ``data/stats.stats_from``'s form, with the rows of each split:
    ``{"rows", "val_rows", "val_nulls", "columns": {label: {bad, min_len, max_len, min, max,
    fractional, overflow, overflow_value, cast}}}``. Columns are summarized over their rows without
    nulls, NaNs, infinities and values beyond a cast's range (``overflow``: how many rows hold one,
    ``overflow_value``: one of them, ``cast``: the type); ``min`` / ``max`` are those of the values
    (an array's elements) after the conversion, ints for integer types."""
    import pyarrow as pa

    val, invalid = split_mask(source, url, table, first_row)
    out: dict[str, Any] = {
        "rows": table.num_rows,
        "val_rows": int(val.sum()) if val is not None else 0,
        "val_nulls": int(invalid.sum()) if invalid is not None else 0,
        "columns": {},
    }
    for col in source.columns:
        bad, over, example = _checked_rows(col, table)
        s: dict[str, Any] = {"bad": int(bad.sum()), "min_len": None, "max_len": None, "min": None, "max": None}
        s.update(fractional=0, overflow=int(over.sum()), overflow_value=example, cast=col.dtype)
        good = ~(bad | over)
        if good.any() and col.dtype not in OBJECT_DTYPES:  # a string or bytes feature: only its nulls matter
            kept = table if good.all() else table.filter(pa.array(good))
            if col.kind == "scalar":  # the values the model gets (after a cast), as the copy's statistics
                v = values_of(col, kept)
                frac = int((v != np.floor(v)).sum()) if v.dtype.kind == "f" else 0
                s.update(min=v.min().item(), max=v.max().item(), fractional=frac)
            else:
                if col.kind == "group":
                    lengths = np.full(table.num_rows, len(col.names))
                elif col.kind == "array":
                    lengths = _flat_values(_array(table.column(resolve(table.schema, col.names[0]))))[1]
                else:
                    lengths = _vector_values(_array(table.column(resolve(table.schema, col.names[0]))))[2]
                low, high = _element_range(col, kept)
                s.update(min_len=int(lengths[good].min()), max_len=int(lengths[good].max()), min=low, max=high)
        out["columns"][col.label] = s
    return out


def merge_stats(parts: Sequence[dict]) -> dict:
    """The statistics of several row groups together."""
    out: dict[str, Any] = {"rows": 0, "val_rows": 0, "val_nulls": 0, "columns": {}}

    def pick(f, a, b):
        return b if a is None else a if b is None else f(a, b)

    for part in parts:
        for k in ("rows", "val_rows", "val_nulls"):
            out[k] += part[k]
        for name, s in part["columns"].items():
            m = out["columns"].get(name)
            if m is None:
                out["columns"][name] = dict(s)
                continue
            m["bad"] += s["bad"]
            m["fractional"] += s["fractional"]
            m["overflow"] = m.get("overflow", 0) + s.get("overflow", 0)
            if m.get("overflow_value") is None:
                m["overflow_value"] = s.get("overflow_value")
            m["min_len"] = pick(min, m["min_len"], s["min_len"])
            m["max_len"] = pick(max, m["max_len"], s["max_len"])
            m["min"] = pick(min, m["min"], s["min"])
            m["max"] = pick(max, m["max"], s["max"])
    return out


def check_file_schema(source: TableSource, url: str, schema) -> None:
    """Raises ValueError naming the file and column when a column is missing or of a type the
    in-place reader does not convert (numbers, lists of numbers, Spark ML Vectors)."""
    import pyarrow as pa

    def numeric(t) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)

    for col in source.columns:
        for name in col.names:
            try:
                t = schema.field(resolve(schema, name)).type
            except KeyError:
                raise ValueError(
                    f"column '{name}' is not in the Parquet file {url} (a partition column, whose values are in "
                    "the folder names, or a file written with another schema)"
                ) from None
            if col.dtype == "string":
                ok = pa.types.is_string(t) or pa.types.is_large_string(t)
            elif col.dtype == "binary":
                ok = pa.types.is_binary(t) or pa.types.is_large_binary(t)
            elif col.kind in ("scalar", "group"):
                ok = numeric(t)
            elif col.kind == "array":
                ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and numeric(t.value_type)
            else:
                ok = pa.types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} >= {
                    "type",
                    "size",
                    "indices",
                    "values",
                }
            if not ok:
                raise ValueError(f"column '{name}' of the Parquet file {url} has type {t}, not the {col.kind} expected")
    if source.split and source.split[0] == "column":
        try:
            schema.field(resolve(schema, source.split[1]))
        except KeyError:
            raise ValueError(f"validation column '{source.split[1]}' is not in the Parquet file {url}") from None


def group_offsets(metadata) -> list[int]:
    """The first row of each row group of a file (its FileMetaData), and the file's row count last."""
    offsets = [0]
    for g in range(metadata.num_row_groups):
        offsets.append(offsets[-1] + metadata.row_group(g).num_rows)
    return offsets
