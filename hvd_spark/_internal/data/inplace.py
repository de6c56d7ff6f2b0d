"""Driver side of reading a table in place (``materialize="auto"`` / ``"never"``): whether a DataFrame
is a plain scan of Parquet files that ranks can read themselves, the files' identity, and one Spark
job that reads the needed columns of every row group once for the statistics and the split's row
counts (no copy is written). What the ranks then read is ``common/sources.py``'s.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import posixpath
import re
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hvd_spark._internal.common import sources
from hvd_spark._internal.common.specs import ColumnInfo
from hvd_spark._internal.data.jobs import spark_job
from hvd_spark._internal.data.store import DATA_META, DATA_USED, FORMAT_VERSION, Store, data_path
from hvd_spark.errors import DataChangedError, DataPreparationError

logger = logging.getLogger(__name__)

# The casts whose values numpy's astype gives as Spark does (integers and floating point); a cast to
# boolean or decimal rounds or maps values in Spark's own way, so such a column is copied.
_NUMERIC = r"(tinyint|smallint|int|bigint|float|double)"
_CAST = re.compile(r"^cast\((?P<src>.+?)#\d+L? as (?P<type>" + _NUMERIC + r"|array<" + _NUMERIC + r">)\)$")
# Spark's own file indexes: anything else (Delta's, with deletion vectors applied at planning) is copied.
_OWN_INDEXES = ("InMemoryFileIndex", "CatalogFileIndex", "PrunedInMemoryFileIndex")


class NotReadableInPlace(ValueError):
    """The scan found a file ranks cannot read in place (another schema, a reader missing on the
    executors): ``materialize="auto"`` copies the data instead."""


_ATTR = re.compile(r"^(?P<src>.+?)#\d+L?$")


@dataclasses.dataclass(frozen=True)
class Scan:
    """A DataFrame that ranks can read in place: its files and, per DataFrame column, the file column."""

    files: tuple[str, ...]
    columns: dict[str, str]  # DataFrame column -> the file's column
    table: str  # what the plan reads, for the log
    root: str = ""  # the table's folder (its file index's one root path), for the split's hash

    def source_name(self, name: str) -> str:
        return self.columns[name]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether a fit reads in place (``scan`` set) or copies, and why (for the log and errors)."""

    scan: Scan | None
    reason: str


def _split_top(text: str) -> list[str]:
    """``a, f(b, c), d`` -> ``["a", "f(b, c)", "d"]``: commas outside brackets."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return [x for x in out if x]


def _nodes(plan: str) -> list[tuple[int, str]]:
    nodes = []
    for line in plan.splitlines():
        stripped = line.lstrip(" :|+-")
        if stripped and not stripped.startswith("=="):
            nodes.append((len(line) - len(stripped), stripped))
    return nodes


def _plans(df) -> tuple[str, str]:
    """The optimized logical plan's text and the physical plan's, every column printed (see
    ``identity.explained_in_full``: wide tables would otherwise print ``... N more fields``)."""
    from hvd_spark._internal.data.identity import explained_in_full

    whole, optimized = explained_in_full(df)
    physical = whole[whole.find("== Physical Plan ==") :] if "== Physical Plan ==" in whole else ""
    return optimized, physical


def read_plan(df, needed: Sequence[str]) -> Decision:
    """Whether ``df`` restricted to the columns ``needed`` is a plain scan of Parquet files: a
    ``Relation ... parquet`` leaf under at most one projection of columns (renamed or cast between
    numeric types). The reason names what prevents it otherwise."""
    from hvd_spark._internal.data.local_copy import made_on_driver
    from hvd_spark._internal.data.materialize import col

    needed = list(dict.fromkeys(needed))
    if made_on_driver(df):  # no file under it: known without printing the plans
        return Decision(None, "it is a local relation (rows the driver holds, e.g. from pandas), not Parquet files")
    try:
        plan, physical = _plans(df.select(*[col(n) for n in needed]))
    except Exception as e:  # noqa: BLE001 - no plan to read: copying is always correct
        return Decision(None, f"its query plan could not be read ({type(e).__name__})")
    nodes = _nodes(plan)
    if not nodes:
        return Decision(None, "its query plan could not be read")
    if any(text.startswith("InMemoryRelation") for _, text in nodes):
        return Decision(None, "it is cached (the cache, not the files, holds its rows)")
    for (d0, _), (d1, _) in zip(nodes, nodes[1:]):
        if d1 <= d0:
            return Decision(None, "its query reads several sources (a join or a union)")
    leaf = nodes[-1][1]
    if not (leaf.startswith("Relation") and leaf.rstrip().endswith(" parquet")):
        return Decision(None, f"it reads {leaf.split('[')[0].strip()[:80]!r}, not Parquet files")
    above = [text for _, text in nodes[:-1]]
    if any(not t.startswith("Project [") for t in above):
        other = next(t for t in above if not t.startswith("Project ["))
        return Decision(None, f"its query has a {other.split(' ')[0]} (only columns are selected in place)")
    if len(above) > 1:
        return Decision(None, "its query has nested projections")
    index = re.search(r"FileScan parquet .*?Location: (\w+)", physical)
    if index is None or index.group(1) not in _OWN_INDEXES:
        how = index.group(1) if index else "no Parquet file scan"
        return Decision(None, f"Spark reads it through {how}, not its own Parquet file index (e.g. a Delta table)")
    columns: dict[str, str] = {}
    if above:
        entries = _split_top(above[0][len("Project [") : above[0].rindex("]")])
        if len(entries) != len(needed):
            return Decision(None, "its query plan could not be read (the projection's columns)")
        for name, entry in zip(needed, entries):
            expr = entry.rsplit(" AS ", 1)[0] if " AS " in entry else entry
            m = _ATTR.match(expr) or _CAST.match(expr)
            if m is None or "(" in m.group("src"):
                return Decision(None, f"column '{name}' is computed ({expr[:80]})")
            columns[name] = m.group("src")
    else:
        columns = {n: n for n in needed}
    files = tuple(urllib.parse.unquote(f) for f in df.inputFiles())  # URIs: "%20" is a space in the name
    if not files:
        return Decision(None, "Spark lists no input files for it")
    for name, src in columns.items():
        marker = f"/{src}="
        if any(marker.lower() in f.lower() for f in files):
            return Decision(None, f"column '{name}' is a partition column (its values are in the folder names)")
    table = leaf[len("Relation") : leaf.index("[")].strip() or f"{len(files)} Parquet file(s)"
    roots = re.search(r"Location: \w+\(1 paths\)\[([^\],]+)\]", physical)
    root = urllib.parse.unquote(roots.group(1)) if roots else table_root(files)
    return Decision(Scan(files, columns, table, root), f"it is a plain scan of {table}")


def list_parquet(url: str, storage_options: dict | None) -> list[str]:
    """The Parquet files at ``url`` (a file, or a folder searched recursively; names starting with ``_``
    or ``.`` are not data), sorted, as URLs of the same scheme."""
    fs, path = sources.file_system(url, storage_options)
    if fs.isfile(path):
        found = [path]
    else:
        found = sorted(
            p
            for p in fs.find(path)
            if not any(part.startswith(("_", ".")) for part in p[len(path.rstrip("/")) :].split("/") if part)
        )
    data = [p for p in found if posixpath.splitext(p)[1].lower() in (".parquet", ".parq", ".pq", "")]
    return [fs.unstrip_protocol(p) for p in data]


def spark_schema(arrow_schema):
    """The Spark schema of a Parquet file's columns: Spark ML Vector structs become VectorUDT."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import from_arrow_type

    fields = []
    for f in arrow_schema:
        t = f.type
        names = {t.field(i).name for i in range(t.num_fields)} if hasattr(t, "num_fields") and t.num_fields else set()
        if names >= {"type", "size", "indices", "values"}:
            fields.append(T.StructField(f.name, VectorUDT(), True))
            continue
        try:
            fields.append(T.StructField(f.name, from_arrow_type(t), True))
        except Exception:  # noqa: BLE001 - a type Spark lacks: a string stand-in, refused if it is used
            fields.append(T.StructField(f.name, T.BinaryType(), True))
    return T.StructType(fields)


def table_root(files: Sequence[str]) -> str:
    """The folder all ``files`` lie in (their longest common prefix up to a ``/``)."""
    prefix = posixpath.commonprefix(list(files))
    return prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""


def source_columns(
    infos: Sequence[ColumnInfo], scan: Scan, weight: ColumnInfo | None = None
) -> tuple[sources.SourceColumn, ...]:
    """The columns ranks read for ``infos`` (stored names set), each with the copy's value type."""
    out, seen = [], set()
    for info in [*infos, *([weight] if weight is not None else [])]:
        if info.stored in seen:
            continue
        seen.add(info.stored)
        if info is weight:
            kind, dtype = "scalar", "float32"  # the copy stores sample weights as float
        else:
            kind = "group" if info.parts else info.kind
            dtype = sources.stored_dtype(kind, info.element_type, info.is_integer)
            kind = "scalar" if kind == "binary" else kind  # bytes, one value per row (as strings are)
        names = tuple(scan.source_name(p) for p in info.parts) if info.parts else (scan.source_name(info.name),)
        out.append(sources.SourceColumn(info.stored, kind, names, dtype, info.name))
    return tuple(out)


def options_for(url: str, store: Store) -> dict | None:
    """The store's storage options for files on the store's own filesystem (a table in the same
    bucket or object store), none for others."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    scheme = {"s3a": "s3", "s3n": "s3"}.get(scheme, scheme)
    store_scheme = store.prefix.split("://", 1)[0] if "://" in store.prefix else "file"
    return store.storage_options if scheme == store_scheme else None


def list_status(files: Sequence[str], storage_options: dict | None) -> list[tuple[int, int]]:
    """(bytes, modification time in ms) of each file, listed by the driver (16 at a time)."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda f: sources.file_status(f, storage_options), files))


def check_first_file(source: sources.TableSource, url: str) -> None:
    """The first file's schema against the columns (one footer read, before any work; the read is
    retried on transient errors, ``common/retry.py``)."""
    fs, path = sources.file_system(url, source.storage_options)
    import pyarrow.parquet as pq

    from hvd_spark._internal.common import retry
    from hvd_spark._internal.common.secrets import url_without_credentials

    def schema():
        with fs.open(path, "rb") as f:
            try:
                return pq.ParquetFile(f).schema_arrow
            except Exception as e:
                if sources.undecodable(e):
                    raise sources.damaged_file(url, "its footer", e) from e
                raise

    found = retry.call(url_without_credentials(url), "reading the first file's schema", schema)
    sources.check_file_schema(source, url, found)


def table_key(files: Sequence[str], source: sources.TableSource) -> str:
    """The store key of a table's scan: its files with their identity, the columns and the split."""
    spec = {
        "in_place": True,
        "files": list(files),
        "status": [list(s) for s in source.status],
        "columns": [dataclasses.asdict(c) for c in source.columns],
        "split": list(source.split),
        "root": source.root,  # the split hashes the files' paths below it
        "hash": 2,
        "format": FORMAT_VERSION,
    }
    return "t" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:23]


def scan_file(config: sources.TableSource, i: int, url: str, use_footers: bool = True) -> list[tuple]:
    """The records of file ``i`` (``url``): ``(file, group, rows, val_rows, stats JSON, "")`` per row
    group with rows, from the footer where it gives the statistics exactly (``data/footers.py``), else
    from the row group's values (the columns the footer lacks only); one ``(i, -1, 0, 0, "", error)``
    record for a file that cannot be read in place. Runs in the scan's Spark tasks or on the driver."""
    from hvd_spark._internal.data import footers as ft

    records = []
    try:
        status = config.status[i] if config.status else None
        pf = sources.open_checked(url, config.storage_options, status)
        sources.check_file_schema(config, url, pf.schema_arrow)
        groups = None
        if use_footers:
            try:
                groups = ft.file_stats(config, url, pf.metadata, pf.schema_arrow)
            except Exception:  # noqa: BLE001 - a footer of a form not foreseen: the values tell
                groups = None
        if groups is None:
            offsets = sources.group_offsets(pf.metadata)
            groups = [(g, offsets[g], None) for g in range(pf.num_row_groups) if pf.metadata.row_group(g).num_rows]
        for g, first, footer in groups:
            stats = _group_stats(pf, config, url, g, first, footer)
            records.append((i, g, stats["rows"], stats["val_rows"], json.dumps(stats), ""))
    except Exception as e:  # noqa: BLE001 - reported by the driver, naming the file
        if sources.undecodable(e):
            e = sources.damaged_file(url, "its footer or a row group", e)
        records = [(i, -1, 0, 0, "", f"{type(e).__name__}: {e}")]
    return records


_RECORD = ("file", "group", "rows", "val", "stats", "error")


def _naming(url: str, problem: str) -> str:
    """``problem`` of the file at ``url``, with the file's name first unless it names it already."""
    from hvd_spark._internal.common.secrets import url_without_credentials

    name = url_without_credentials(url)
    return problem if posixpath.basename(name) in problem else f"{name}: {problem}"


def _scan_files(
    spark,
    files: Sequence[str],
    source: sources.TableSource,
    slots: int,
    only: Sequence[int] | None = None,
    use_footers: bool = True,
) -> list[dict]:
    """One Spark job: :func:`scan_file` of every file (``only``: of the files at these indexes), spread
    over the executors. Returns one record per row group (or per file that cannot be read in place)."""
    config = dataclasses.replace(source)
    rows = [(i, files[i]) for i in (range(len(files)) if only is None else only)]
    parts = max(1, min(len(rows), 4 * max(1, slots)))

    def scan(batches):
        import pyarrow as pa

        from hvd_spark._internal.data.inplace import scan_file

        for batch in batches:
            for i, url in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                records = scan_file(config, i, url, use_footers)
                if records:
                    yield pa.RecordBatch.from_pydict({k: [r[j] for r in records] for j, k in enumerate(_RECORD)})

    schema = "file long, group long, rows long, val long, stats string, error string"
    frame = spark.createDataFrame(rows, "file long, url string").repartition(parts)
    out = frame.mapInArrow(scan, schema).collect()
    return [r.asDict() for r in out]


def _scan_on_driver(
    files: Sequence[str], source: sources.TableSource, threads: int, only: Sequence[int], use_footers: bool = True
) -> list[dict]:
    """:func:`scan_file` of the files at ``only`` in this process, ``threads`` at a time (a local
    master: its executors are this machine's cores, and a Spark job would only add its start)."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        found = pool.map(lambda i: scan_file(source, i, files[i], use_footers), only)
        return [dict(zip(_RECORD, r)) for records in found for r in records]


def _group_stats(pf, source: sources.TableSource, url: str, g: int, first: int, footer: dict | None) -> dict:
    """The statistics of row group ``g`` of ``pf`` (a ``pyarrow.parquet.ParquetFile``): ``footer``'s
    (``footers.file_stats``), with the columns it lacks read from the row group (every needed column
    when ``footer`` is None)."""
    from hvd_spark._internal.data import footers

    if footer is not None and not footer["missing"]:
        return footers.completed(source, footer, None)
    sub = (
        source
        if footer is None
        else dataclasses.replace(source, columns=footers.missing_columns(source, footer["missing"]))
    )
    columns = [sources.resolve(pf.schema_arrow, n) for n in sub.file_columns()]
    table = pf.read_row_group(g, columns=columns, use_threads=False)
    scanned = sources.row_group_stats(sub, url, table, first)
    return scanned if footer is None else footers.completed(source, footer, scanned)


def _footers_on_driver(files: Sequence[str], source: sources.TableSource) -> dict[int, list[dict]]:
    """The records of the files whose footers give every statistic (``data/footers.py``), read by the
    driver (16 files at a time, each checked against its listed size and time, through the retry
    policy): {file index: its row groups' records}. Files left out (a footer without statistics, a
    column summarized from values only, a file that does not open) go to the scan's Spark job, which
    reports their errors as it would. Raises DataChangedError for a file changed since it was listed."""
    from hvd_spark._internal.common import retry
    from hvd_spark._internal.common.secrets import url_without_credentials
    from hvd_spark._internal.data import footers

    def one(i: int) -> list[dict] | None:
        url = files[i]
        status = source.status[i] if source.status else None
        try:
            pf = retry.call(
                url_without_credentials(url),
                "reading the Parquet footer",
                lambda: sources.open_checked(url, source.storage_options, status),
            )
            try:
                sources.check_file_schema(source, url, pf.schema_arrow)
                if footers.needs_values(source, pf.schema_arrow):
                    return None
                found = footers.file_stats(source, url, pf.metadata, pf.schema_arrow)
            finally:
                with contextlib.suppress(Exception):  # its mapping or remote handle: the footer is read
                    pf.close()
        except DataChangedError:
            raise
        except Exception as e:  # noqa: BLE001 - the Spark job reads it and reports what fails
            logger.debug("the footer of %s is left to the scan's Spark job: %s", url, e)
            return None
        complete = [(g, st) for g, _, st in found if st is not None and not st["missing"]]
        if len(complete) < len(found):
            return None
        return [
            {
                "file": i,
                "group": g,
                "rows": st["rows"],
                "val": st["val_rows"],
                "error": "",
                "stats": json.dumps(footers.completed(source, st, None)),
            }
            for g, st in complete
        ]

    first = one(0) if files else None
    if first is None:  # the first file needs its values: so do the others, most likely (one schema)
        return {}
    out = {0: first}
    with ThreadPoolExecutor(max_workers=16) as pool:
        for i, records in zip(range(1, len(files)), pool.map(one, range(1, len(files)))):
            if records is not None:
                out[i] = records
    return out


_META_KEYS = ("key", "files", "units", "train_rows", "val_rows", "train_files", "val_files", "stats")


def _cached_scan(store: Store, meta_path: str, scan: Scan) -> dict | None:
    """The scan kept at ``meta_path`` by an earlier fit, or None (none, or one that does not read:
    damaged, cut short, of another version; logged, and the table is scanned again)."""
    try:
        meta = store.files.read_json(meta_path)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a cache: whatever fails, scanning again is correct
        logger.warning("ignoring the kept scan of %s (%s); scanning it again", scan.table, e)
        return None
    problem = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        problem = f"format {meta.get('format') if isinstance(meta, dict) else None!r}, not {FORMAT_VERSION}"
    elif any(k not in meta for k in _META_KEYS) or not isinstance(meta["stats"], dict):
        problem = "fields missing"
    elif meta["files"] != list(scan.files):
        problem = "other files"
    elif (
        sum(int(u[2]) for u in meta["units"]) != meta["train_rows"]
        or sum(int(u[3]) for u in meta["units"]) != meta["val_rows"]
    ):
        problem = "its row counts do not add up"
    if problem is not None:
        logger.warning(
            "ignoring the kept scan of %s at %s (%s); scanning it again",
            scan.table,
            store.files.url(meta_path),
            problem,
        )
        return None
    return meta


def scan_table(
    spark,
    store: Store,
    scan: Scan,
    source: sources.TableSource,
    *,
    reuse: bool,
    check,
    slots: int = 2,
    use_footers: bool = True,
    on_driver: bool = False,
) -> dict:
    """The table's row groups, rows per split and statistics (``check(stats)`` raises for data that
    cannot be trained on), from the store when an earlier fit (in any application) scanned the same
    files (same paths, sizes and modification times) with the same columns and split, else from the
    files' footers where they hold the statistics (``data/footers.py``) and one Spark job for the rest,
    kept in the store (``data/<key>/_hvd_spark_meta.json``; ``reuse=False``: neither looked up nor
    kept). A kept scan that does not read is ignored (logged) and the table scanned again.
    ``use_footers=False``: every statistic from the values (the reference the footers are held to).
    ``on_driver``: the files are read by this process, ``slots`` threads (a local master), not by a
    Spark job."""
    key = table_key(scan.files, source)
    meta_path = posixpath.join(data_path(store, key), DATA_META)
    if reuse:
        meta = _cached_scan(store, meta_path, scan)
        if meta is not None:
            check(meta["stats"])
            try:
                store.files.write_json(posixpath.join(data_path(store, key), DATA_USED), {"time": time.time()})
            except Exception:  # noqa: BLE001 - only for Store.cleanup's age: never fails a fit
                pass
            logger.info(
                "reusing the scan of %s (%d files unchanged): no pass over the data", scan.table, len(scan.files)
            )
            return meta
    t0 = time.time()
    by_footer = _footers_on_driver(scan.files, source) if use_footers else {}
    records = [r for f in sorted(by_footer) for r in by_footer[f]]
    rest = [i for i in range(len(scan.files)) if i not in by_footer]
    if rest and on_driver:
        records += _scan_on_driver(scan.files, source, slots, rest, use_footers)
    elif rest:
        try:
            with spark_job(
                f"scanning {len(rest)} of the {len(scan.files)} Parquet files of {scan.table} on the executors"
            ):
                records += _scan_files(spark, scan.files, source, slots, rest, use_footers)
        except Exception as e:  # noqa: BLE001 - e.g. a filesystem the executors lack: the copy reads through Spark
            cause = e.root_cause if isinstance(e, DataPreparationError) else f"{type(e).__name__}: {e}"
            raise NotReadableInPlace(f"the scan of its files failed on the executors: {cause}") from e
    errors = [r for r in records if r["error"]]
    if errors:
        first = min(errors, key=lambda r: r["file"])
        if first["error"].startswith("DataChangedError"):
            raise DataChangedError(first["error"].split(": ", 1)[1])
        raise NotReadableInPlace(_naming(scan.files[first["file"]], first["error"].split(": ", 1)[-1]))
    records.sort(key=lambda r: (r["file"], r["group"]))
    stats = sources.merge_stats([json.loads(r["stats"]) for r in records])
    check(stats)
    units = [[r["file"], r["group"], r["rows"] - r["val"], r["val"]] for r in records]
    per_file: dict[int, list[int]] = {}
    for f, _, train, val in units:
        acc = per_file.setdefault(f, [0, 0])
        acc[0] += train
        acc[1] += val
    meta = {
        "key": key,
        "in_place": True,
        "table": scan.table,
        "files": list(scan.files),
        "units": units,
        "train_rows": sum(u[2] for u in units),
        "val_rows": sum(u[3] for u in units),
        "train_files": [[scan.files[f], c[0]] for f, c in sorted(per_file.items()) if c[0]],
        "val_files": [[scan.files[f], c[1]] for f, c in sorted(per_file.items()) if c[1]],
        "stats": stats,
        "format": FORMAT_VERSION,
        "created": time.time(),
    }
    logger.info(
        "scanned %s in place in %.1fs%s: %d files (%d from their footers alone), %d row groups, %d train / %d val "
        "rows (nothing copied)",
        scan.table,
        time.time() - t0,
        " on the driver" if on_driver and rest else "",
        len(scan.files),
        len(by_footer),
        len(units),
        meta["train_rows"],
        meta["val_rows"],
    )
    if reuse:
        try:
            store.files.write_json(meta_path, meta)
        except Exception as e:  # noqa: BLE001 - the scan is done; a later fit scans again
            logger.warning("could not keep the scan of %s in the store: %s", scan.table, e)
    return meta


def check_unchanged(files: Sequence[str], source: sources.TableSource) -> None:
    """Raises DataChangedError when a file was removed or changed since the fit listed it (after
    training: a file changed while ranks read it)."""
    for url, expected in zip(files, source.status):
        try:
            now = sources.file_status(url, source.storage_options)
        except FileNotFoundError:
            raise DataChangedError(
                f"{url} was removed while the fit trained on it (was the table overwritten?): the model may have "
                "been trained on parts of two versions of the table and is not returned. Fit again."
            ) from None
        if tuple(now) != tuple(expected):
            raise DataChangedError(
                f"{url} changed while the fit trained on it ({expected[0]} bytes modified at {expected[1]} ms "
                f"when listed, {now[0]} bytes modified at {now[1]} ms now): the model may have been trained on "
                "parts of two versions of the table and is not returned. Fit again."
            )
