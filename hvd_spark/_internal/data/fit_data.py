"""A fit's data, on the driver: what it trains on (a DataFrame, or ``fit_on_parquet``'s files), whether
the ranks read the table's own Parquet files in place or a copy in the store, the record that names
the data for its run, the scan or the copy itself, and the lease that keeps it while the fit reads it.

The fit's steps (``ml/steps.py``) call these with plain values: nothing here knows the estimator."""

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common import retry, settings
from hvd_spark._internal.common.contracts import DataSpec
from hvd_spark._internal.common.specs import with_stored_names
from hvd_spark._internal.data import leases
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.identity import data_identity, dataset_key
from hvd_spark._internal.data.store import Store, data_path, release_data
from hvd_spark.errors import StoreUnavailableError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FitInput:
    """What a fit trains on: ``fit(df)``'s DataFrame, or ``fit_on_parquet``'s files read in place.

    ``frame`` holds the columns' names and types and the Spark session (for ``fit_on_parquet``, an
    empty DataFrame of the files' schema); ``scan`` (``inplace.Scan``) and ``validation_files`` are
    ``fit_on_parquet``'s files, given rather than found in a query plan."""

    frame: Any
    scan: Any = None
    validation_files: tuple = ()
    sample: Any = None  # fit_on_parquet: columns -> the first row of its files (``first_row``)

    @property
    def given(self) -> bool:
        """True for ``fit_on_parquet``'s files: read in place or not at all."""
        return self.scan is not None

    def first_row(self, columns: list[str]) -> dict | None:
        """The values of ``columns`` in the first row (a Spark job for a DataFrame; the first file's first
        row for ``fit_on_parquet``), None when there are no rows."""
        if self.sample is not None:
            return self.sample(columns)
        rows = self.frame.select(*columns).limit(1).collect()
        return rows[0].asDict() if rows else None


def parquet_input(path: str, validation_path: str | None, store: Store, session: Callable[[], Any]) -> FitInput:
    """``fit_on_parquet``'s files: those at ``path`` and ``validation_path`` (a file or a folder searched
    recursively, at any URL the store's filesystem reaches), with an empty DataFrame of the first file's
    schema for the columns' checks, made in the SparkSession ``session()`` gives (the driver's
    ``active_session``), asked for once the files are found.

    Raises:
        ValueError: no Parquet files at ``path`` or ``validation_path``, or only validation files at ``path``.
    """

    from hvd_spark._internal.data import inplace

    found = {}
    for role, url in (("path", path), ("validation_path", validation_path)):
        if url is None:
            continue
        files = inplace.list_parquet(str(url), inplace.options_for(str(url), store))
        if not files:
            raise ValueError(f"fit_on_parquet: no Parquet files at {role}={url!r}.")
        found[role] = files
    import pyarrow.parquet as pq

    from hvd_spark._internal.common import sources

    fs, first = sources.file_system(found["path"][0], inplace.options_for(found["path"][0], store))
    with fs.open(first, "rb") as f:
        schema = pq.ParquetFile(f).schema_arrow
    spark = session()
    frame = spark.createDataFrame([], inplace.spark_schema(schema))
    val_files = set(found.get("validation_path", []))
    found["path"] = [f for f in found["path"] if f not in val_files]  # a validation folder inside path
    if not found["path"]:
        raise ValueError(f"fit_on_parquet: every Parquet file at path={path!r} is a validation_path file.")
    every = tuple(found["path"] + found.get("validation_path", []))
    scan = inplace.Scan(every, {n: n for n in schema.names}, str(path), str(path))

    def sample(columns: list[str]) -> dict | None:
        for url in found["path"]:
            fs, local = sources.file_system(url, inplace.options_for(url, store))
            with fs.open(local, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=1, columns=list(columns)):
                    if batch.num_rows:  # past empty row groups
                        return batch.to_pylist()[0]
        return None

    return FitInput(frame, scan, tuple(found.get("validation_path", ())), sample)


def read_in_place(
    data: FitInput, f_infos, l_infos, w_info, validation, store: Store, *, reader: str, materialize: str, seed: int
):
    """Step 1c: whether the ranks read the DataFrame's own Parquet files (``materialize``): the plain
    scan (``inplace.read_plan``) and its files' identity, or None (the data is copied), with the reason.
    The log says which path and why; ``materialize="never"`` on a DataFrame that cannot be read in place
    is refused here, before any work."""
    from hvd_spark._internal.data import inplace

    if data.given:  # fit_on_parquet: the files are given
        if reader != "arrow":
            raise ValueError(f"fit_on_parquet reads with reader='arrow'. Received: reader={reader!r}.")
        decision = inplace.Decision(data.scan, f"fit_on_parquet({data.scan.table!r})")
    elif materialize == "always":
        logger.info("copying the data to the store (materialize='always')")
        return None, "materialize='always'"
    elif reader != "arrow":
        decision = inplace.Decision(None, f"reader={reader!r} reads copies only")
    else:
        needed = [n for i in [*f_infos, *l_infos] for n in (i.parts or (i.name,))]
        needed += [w_info.name] if w_info is not None else []
        needed += [validation] if isinstance(validation, str) else []
        decision = inplace.read_plan(data.frame, needed)
    found = None
    if decision.scan is not None:
        scan = decision.scan
        options = inplace.options_for(scan.files[0], store)
        try:
            status = tuple(inplace.list_status(scan.files, options))
            found = (scan, status, options, data.validation_files)
            named_f, named_l, (named_w,) = with_stored_names(f_infos, l_infos, [w_info])
            source = table_source(found, named_f, named_l, named_w, validation, seed)
            inplace.check_first_file(source, scan.files[0])
        except Exception as e:  # noqa: BLE001 - a file Spark lists but the ranks cannot read: copy it
            if isinstance(e, StoreUnavailableError) or retry.is_transient(e):
                raise  # an outage (retried for the whole window), not a property of the files: never a copy
            if data.given:
                raise ValueError(f"fit_on_parquet: {data.scan.table!r} cannot be trained on: {e}") from e
            decision = inplace.Decision(None, f"{type(e).__name__}: {e}")
            found = None
    if found is None:
        if materialize == "never":
            raise ValueError(
                f"materialize='never': the DataFrame cannot be read in place because {decision.reason.rstrip('.')}. "
                "Ranks read a plain scan of Parquet files (a path or a catalog table, columns selected, renamed or "
                "cast between numbers). Use materialize='auto' to copy it to the store."
            )
        logger.info("copying the data to the store: it cannot be read in place because %s", decision.reason)
        return None, decision.reason
    logger.info("reading the data in place, without a copy: %s", decision.reason)
    return found, decision.reason


def table_source(found, f_infos, l_infos, w_info, validation, seed: int):
    """The ``sources.TableSource`` of a scan found by :func:`read_in_place` for named columns."""
    from hvd_spark._internal.common import sources
    from hvd_spark._internal.data import inplace

    scan, status, options, val_files = found
    columns = inplace.source_columns([*f_infos, *l_infos], scan, w_info)
    if val_files:
        split: tuple = ("files", tuple(val_files))
    elif isinstance(validation, str):
        split = ("column", scan.source_name(validation))
    elif validation:
        split = ("fraction", float(validation), int(seed))
    else:
        split = ()
    return sources.TableSource(columns, split, status, options, scan.root or inplace.table_root(scan.files))


@dataclasses.dataclass(frozen=True)
class Identified:
    """Step 2b: what names the fit's data (``plan.check_data``'s record) and, for a copy, its identity."""

    record: dict
    identity: Any = None  # identity.DataIdentity under reuse_data="auto" (a copy), reused by step 3


def identify(
    dataset, source, validation, *, random_seed: int, sample_weight_col: str | None, copy_reason: str
) -> Identified:
    """Step 2b: what names the fit's data, for the run's record (``plan.check_data``), found without
    writing anything: a table read in place by its files as step 1 listed them (``source``: what
    :func:`read_in_place` found); a copy by ``data_identity`` (the query and its input files: one listing
    job, reused by step 3); both with what splits them. Nothing of the layout (ranks, files): an elastic
    or resized run keeps its data."""
    fraction = bool(validation) and not isinstance(validation, str)
    record: dict[str, Any] = {
        "validation": validation,
        "random_seed": random_seed if fraction else None,
        "sample_weight_col": sample_weight_col,
    }
    if source is not None:
        from hvd_spark._internal.data import inplace

        scan, status, _, val_files = source
        record.update(
            read="in place",
            table=scan.table,
            root=scan.root or inplace.table_root(scan.files),
            files=sorted([url, int(st[0]), int(st[1])] for url, st in zip(scan.files, status)),
            validation_files=sorted(val_files) or None,
        )
        return Identified(record, None)
    identity = data_identity(dataset, "auto")
    identified = identity.established and "session" not in identity.kinds
    record.update(read="copied", why_copied=copy_reason, identified=identified)
    if identified:
        # the plan's semanticHash names rows held in it (the same in every JVM: no file source in it); a
        # Range's rows are named by the query's text, and its hash changes with its partitions
        local_rows = set(identity.kinds) <= {"content"} and identity.local_rows
        in_plan = str(dataset.semanticHash()) if local_rows else None
        record.update(query=identity.query, rows_in_plan=in_plan, files=[list(st) for st in identity.status])
    else:
        record["why"] = (
            identity.reason
            if not identity.established
            else "an RDD or a cache of the Spark application that fitted it, which no other application can name"
        )
    return Identified(record, identity)


@dataclasses.dataclass(frozen=True)
class Written:
    """Step 3: the materialized data."""

    data: DataSpec
    key: str
    meta: dict
    seed: int
    seconds: float
    ephemeral: bool = False  # written for this fit only (its input has no identity): removed at its end
    source: Any = None  # sources.TableSource: the table is read in place (meta: inplace.scan_table's)
    record: dict | None = None  # step 2b's data record, for run.json


def scan_in_place(
    spark, store: Store, scan, source, spec: DataSpec, record, *, reuse: bool, check, options, seed: int, t0: float
) -> Written:
    """Step 3, a table read in place: the ranks read its own files, one pass for the statistics
    (``inplace.scan_table``), no copy. ``options``: the launch options (slots, master).

    Raises:
        inplace.NotReadableInPlace: the scan found what the ranks cannot read.
    """
    from hvd_spark._internal.common.sessions import is_connect
    from hvd_spark._internal.common.topology import is_local_master
    from hvd_spark._internal.data import inplace

    meta = inplace.scan_table(
        spark,
        store,
        scan,
        source,
        reuse=reuse,
        check=check,
        slots=options.slots,
        on_driver=is_local_master(options.master) and not is_connect(spark),
    )
    return Written(spec, meta["key"], meta, seed, time.time() - t0, ephemeral=not reuse, source=source, record=record)


def copy(
    dataset,
    store: Store,
    spec: DataSpec,
    ident: Identified,
    *,
    validation,
    seed: int,
    reuse_data: str,
    num_proc: int,
    slots: int,
    partitions_per_process: int | None,
    check,
    t0: float,
) -> Written:
    """Step 3, a copy: the data written to Parquet in the store in one pass over the input, its values
    checked (``check``) in the same pass; or the same data, written before and provably unchanged, reused
    (``reuse_data``). The copy has ``partitions_per_process`` files per rank when set, else as many as
    ``data_mod.num_files`` gives for ``num_proc`` ranks on ``slots`` task slots."""
    f_infos, l_infos, w_info = list(spec.features), list(spec.labels), spec.weight
    columns = f_infos + l_infos + ([w_info] if w_info else [])
    prepared = data_mod.prepare(dataset, f_infos, l_infos, w_info, validation, seed)
    if reuse_data == "auto" and ident.identity is not None:
        identity = ident.identity
    else:
        identity = data_identity(dataset, reuse_data)
    if not identity.established:
        logger.info("writing the data anew (it will not be reused by later fits): %s", identity.reason)
    else:
        logger.debug("data identity: %s", identity.reason)
    key = dataset_key(prepared, columns, validation, seed, identity)
    # 4 bytes a value; a string is taken as 64 (row groups of the copy are sized from this)
    row_values = sum((16 if s.dtype == "string" else s.elements or 1) for s in spec.inputs)
    row_values += sum((s.elements or 1) for s in spec.outputs) + 1
    files = num_proc * partitions_per_process if partitions_per_process else data_mod.num_files(num_proc, slots)
    meta = data_mod.materialize(prepared, store, key, columns, row_values * 4, num_proc, check=check, files=files)
    return Written(spec, key, meta, seed, time.time() - t0, ephemeral=not identity.established, record=ident.record)


@contextlib.contextmanager
def removed_after(store: Store, written: Written):
    """While the fit trains, a lease in the data's folder says so (``Store.cleanup`` and
    ``remove_dataset`` leave it alone). Data written for one fit only (its input has no identity to
    reuse it by) is removed when the fit ends, whatever the outcome: nothing would ever read it again."""
    from hvd_spark._internal.data.store import DATA_READER_PREFIX

    reader = f"{data_path(store, written.key)}/{DATA_READER_PREFIX}{uuid.uuid4().hex[:12]}.json"
    taken = time.time()
    try:
        with leases.lease(store.files, reader, settings.LEASE_HEARTBEAT, key=written.key):
            yield
    finally:
        if not written.ephemeral:
            try:  # Store.cleanup may remove it from now on
                with retry.at_most(settings.LEASE_HEARTBEAT):
                    release_data(store, written.key, taken)
            except Exception as e:  # noqa: BLE001 - the store is unreachable: the fit's own outcome matters more
                logger.warning("could not mark this fit's use of data %s as ended: %s", written.key, e)
        if written.ephemeral:
            try:
                with retry.at_most(settings.LEASE_HEARTBEAT):  # a clean-up: the fit's outcome first
                    store.files.rm(data_path(store, written.key))
            except Exception as e:  # the store is unreachable: the fit's own outcome matters more
                logger.warning("could not remove this fit's data %s: %s", written.key, e)
