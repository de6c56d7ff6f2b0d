"""The identity of a DataFrame's data: what its plan reads (files with sizes and modification times,
tables, data held in the plan) and whether that proves the data unchanged, so that a later fit may
reuse what an earlier one wrote. Driver side."""

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import re
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from hvd_spark._internal.common.specs import (
    ColumnInfo,
)
from hvd_spark._internal.data.jobs import spark_job
from hvd_spark._internal.data.store import FORMAT_VERSION

logger = logging.getLogger(__name__)


# Functions whose value differs from one evaluation of the data to the next.
_NONDETERMINISTIC = re.compile(
    r"\b(rand|randn|random|uuid|shuffle|monotonically_increasing_id|spark_partition_id|input_file_name|"
    r"current_timestamp|current_date|current_time|localtimestamp|now|unix_timestamp|try_reflect|reflect)\(",
    re.IGNORECASE,
)
_FILE_FORMATS = {"parquet", "orc", "json", "csv", "text", "avro", "binaryfile", "delta"}
_CONTENT_LEAVES = {"LocalRelation", "Range", "OneRowRelation", "LocalTableScan"}  # the data is in the plan
_SESSION_LEAVES = {"LogicalRDD", "ExternalRDD", "InMemoryRelation"}  # an RDD or a cache of this application


@dataclasses.dataclass(frozen=True)
class DataIdentity:
    """What makes two fits' inputs the same data (see :func:`data_identity`).

    ``digest`` goes into the materialization key; ``established`` says whether equal digests prove
    equal data (else the key is unique to this fit and its materialization is never reused);
    ``reason`` is for the log."""

    digest: str
    established: bool
    reason: str
    files: int = 0
    # What the digest was made of, for comparing a run's data across driver processes (ml/plan.py's
    # check_data): the leaves' kinds ("files", "content", "session"), a digest of the optimized plan's
    # text without expression ids (``semanticHash`` differs from one JVM to the next for file sources),
    # and the input files as (path, bytes, modification time in ms).
    kinds: tuple[str, ...] = ()
    query: str = ""
    status: tuple[tuple[str, int, int], ...] = ()
    local_rows: bool = False  # rows of createDataFrame in the plan (LocalRelation): its semanticHash names them
    # Whether ``digest`` is the same in every JVM (Spark application, driver process): a query over Parquet or
    # ORC files whose optimized plan's text names all of its computation (``stable_query``); else it holds
    # ``semanticHash``, which differs from one JVM to the next for file sources.
    portable: bool = False


def plan_leaves(plan: str) -> list[str]:
    """The leaf operators of a logical plan as ``explain`` prints it: one node a line, children
    indented below their parent. The leaves of what an ``InMemoryRelation`` caches (its physical plan,
    printed below it) come with a ``"cached: "`` prefix."""
    nodes = []
    for line in plan.splitlines():
        stripped = line.lstrip(" :|+-")
        if stripped and not stripped.startswith("=="):  # AQE's "== Final Plan ==" headings are not nodes
            nodes.append((len(line) - len(stripped), stripped))
    leaves, cache_depth = [], None
    for i, (depth, text) in enumerate(nodes):
        if cache_depth is not None and depth <= cache_depth:
            cache_depth = None
        if text.startswith("InMemoryRelation"):
            cache_depth = depth  # what it caches follows, as a physical plan: its leaves are marked
            continue
        if i + 1 >= len(nodes) or nodes[i + 1][0] <= depth:
            leaves.append(("cached: " if cache_depth is not None else "") + text)
    return leaves


_EXPLAIN_LOCK = threading.Lock()


def _explain_text(df) -> str:
    """``df.explain(extended=True)``'s text. ``explain`` only prints it, and capturing stdout is not
    thread-safe (fits run from several threads in a tuning sweep), so the text is asked for the way
    ``explain`` asks for it (Connect: ``_explain_string``; classic: the JVM's ``explainString``),
    falling back to a captured ``explain`` under a lock."""
    from hvd_spark._internal.common import internals
    from hvd_spark._internal.common.sessions import is_connect

    try:
        return internals.explain_string(df, is_connect(df.sparkSession))
    except Exception as e:  # noqa: BLE001 - another pyspark's internals: the public call below
        logger.debug("explain text through pyspark's internals failed (%s); capturing explain()", e)
    buf = io.StringIO()
    with _EXPLAIN_LOCK, contextlib.redirect_stdout(buf):
        df.explain(extended=True)
    return buf.getvalue()


_MAX_FIELDS = "spark.sql.debug.maxToStringFields"  # columns a plan prints before "... N more fields"
_EXPLAIN_CONF_LOCK = threading.Lock()


def explained_in_full(df) -> tuple[str, str]:
    """:func:`_explained` with every column printed: the session's ``spark.sql.debug.maxToStringFields``
    is raised while the plans are asked for, under a lock (wide tables would otherwise print
    ``... N more fields`` in place of columns and expressions), and put back after."""
    conf = df.sparkSession.conf
    with _EXPLAIN_CONF_LOCK:
        try:
            old = conf.get(_MAX_FIELDS, None)
            conf.set(_MAX_FIELDS, "100000")
        except Exception:  # noqa: BLE001 - a session that refuses the conf: the plan as it prints
            old = False
        try:
            return _explained(df)
        finally:
            _restore_conf(conf, _MAX_FIELDS, old)


def _restore_conf(conf, key: str, old) -> None:
    """Puts the session's conf ``key`` back (``old``: its value, None: unset, False: not changed)."""
    if old is False:
        return
    try:
        if old is None:
            conf.unset(key)
        else:
            conf.set(key, old)
    except Exception:  # noqa: BLE001 - the plan is read; the conf is cosmetic
        pass


# What a plan's text names without saying what it computes: Python and pandas UDFs and functions over
# rows (by name only), typed Scala lambdas and objects, Scala UDFs, scripts; and text cut short.
_OPAQUE = re.compile(
    r"Python|InPandas|InArrow|pythonUDF|\bUDF\b|ScalaUDF|MapPartitions|MapElements|AppendColumns|"
    r"DeserializeToObject|SerializeFromObject|MapGroups|CoGroup|ScriptTransformation|TypedFilter|"
    r"more fields|more characters",
    re.IGNORECASE,
)
_PORTABLE_FORMATS = {"parquet", "orc"}  # whose values no reader option changes (CSV's, JSON's do: not printed)


def stable_query(df, optimized: str, kinds: set[str], leaves: Sequence[str]) -> str | None:
    """A digest of ``df``'s query that is the same in every JVM and names its whole computation: its
    optimized plan's text in full (:func:`explained_in_full`) without expression ids, and its schema
    (a plan's leaves print column names, not types). None when the text does not name all of it: a
    source other than Parquet or ORC files (CSV's options, rows held in the plan, RDDs are not
    printed), a UDF or a function over rows (printed by name). The input files' identity is apart."""
    if kinds != {"files"}:
        return None
    for leaf in leaves:
        if not leaf.startswith("Relation") or leaf.rsplit(" ", 1)[-1].strip().lower() not in _PORTABLE_FORMATS:
            return None
    if "more fields" in optimized:
        try:
            _, optimized = explained_in_full(df)
        except Exception as e:  # noqa: BLE001 - no full text: the JVM's own hash, as before
            logger.debug("the full plan could not be read (%s)", e)
            return None
    if _OPAQUE.search(optimized):
        return None
    text = _RANGE_SPLITS.sub("", _EXPR_ID.sub("", optimized)).strip()
    try:  # ANSI mode decides what a cast out of range gives (an error or a null); the plan does not print it
        ansi = str(df.sparkSession.conf.get("spark.sql.ansi.enabled", None))
    except Exception:  # noqa: BLE001 - a session that does not say
        ansi = "?"
    return hashlib.sha256("\n".join([text, df.schema.json(), ansi]).encode()).hexdigest()[:32]


def _explained(df) -> tuple[str, str]:
    """The query's plans as ``explain(extended=True)`` prints them (public, classic and Connect): the
    whole text, and its optimized logical plan."""
    text = _explain_text(df)
    start = text.find("== Optimized Logical Plan ==")
    end = text.find("== Physical Plan ==")
    if start < 0:
        return text, text
    return text, text[start + len("== Optimized Logical Plan ==") : end if end > start else None]


def classify_leaves(leaves: Sequence[str]) -> tuple[set[str], list[str]]:
    """Sorts plan leaves into what establishes their data's identity: ``"files"`` (a file-based
    relation: its files), ``"content"`` (the data is in the plan), ``"session"`` (an RDD or a cache of
    this application), and returns the kinds found and the leaves that establish nothing."""
    kinds: set[str] = set()
    unknown = []
    for leaf in leaves:
        if leaf.startswith("cached: "):
            # A cache over files or another source keeps the data of when it was filled, and neither
            # inputFiles() nor the plan shows that: only caches of RDDs and local data are this session's.
            physical = re.sub(r"^\*\(\d+\)\s*", "", leaf[len("cached: ") :])
            if re.match(r"(Scan ExistingRDD|ExistingRDD|LocalTableScan|Range|Scan OneRowRelation)\b", physical):
                kinds.add("session")
            else:
                unknown.append(f"a cached DataFrame over {physical}")
            continue
        name = re.split(r"[\s\[(]", leaf, maxsplit=1)[0]
        if name == "Relation":
            fmt = leaf.rsplit(" ", 1)[-1].strip().lower()
            if fmt in _FILE_FORMATS:
                kinds.add("files")
            else:
                unknown.append(leaf)
        elif name == "HiveTableRelation":
            kinds.add("files")
        elif name in _CONTENT_LEAVES:
            kinds.add("content")
        elif name in _SESSION_LEAVES:
            kinds.add("session")
        else:
            unknown.append(leaf)
    return kinds, unknown


def _file_status(spark, paths: Sequence[str]) -> list[tuple[str, int, int]]:
    """(path, bytes, modification time in ms) of every file at ``paths`` (files or folders), listed by
    Spark through the cluster's own filesystems (``binaryFile`` without its content column)."""
    if not paths:
        return []
    rows = (
        spark.read.format("binaryFile")
        .option("recursiveFileLookup", "true")
        .load(list(paths))
        .select("path", "length", "modificationTime")
        .collect()
    )
    return sorted((r["path"], int(r["length"]), int(r["modificationTime"].timestamp() * 1000)) for r in rows)


def data_identity(df, reuse: str = "auto") -> DataIdentity:
    """Identifies the data behind ``df`` for reusing an earlier materialization (``reuse_data``).

    The query plan (``semanticHash``) names the computation. The data it reads is identified by:

    * file-based relations (a Parquet / ORC / CSV / JSON path, a catalog table over files): every
      input file with its size and modification time, listed now; an overwritten table or path has
      other files or times, so it is never mistaken for the old data;
    * data held in the plan (``createDataFrame`` of local rows, ``range``): the plan itself;
    * an RDD or a cached DataFrame: this application only (its id is part of the identity).

    Anything else (JDBC, streaming or other sources, a nondeterministic function such as ``rand``)
    cannot be identified: the fit writes the data anew, and ``reuse_data="always"`` reuses by plan.
    """
    plan = df.semanticHash()
    if reuse == "never":
        return DataIdentity(f"never-{uuid.uuid4().hex}", False, "reuse_data='never'")
    if reuse == "always":
        return DataIdentity(f"plan-{plan}", True, "reuse_data='always' (the query plan only)")
    whole, optimized = _explained(df)
    kinds, unknown = classify_leaves(plan_leaves(optimized))
    if unknown:
        return DataIdentity(
            f"unknown-{uuid.uuid4().hex}",
            False,
            f"its source {unknown[0][:120]!r} has no identity hvd_spark can check (only files, data in the plan, "
            "RDDs and caches of this application do)",
        )
    nondet = _NONDETERMINISTIC.search(whole)  # the analyzed plan still names current_date() & co.
    if nondet:
        return DataIdentity(
            f"nondeterministic-{uuid.uuid4().hex}",
            False,
            f"its query calls {nondet.group(1)}(), whose values differ from one evaluation to the next",
        )
    leaves = plan_leaves(optimized)
    portable = stable_query(df, optimized, kinds, leaves)
    # The JVM's semanticHash names the computation within one application; a portable digest in any.
    parts: dict[str, Any] = {"plan": plan} if portable is None else {"query": portable}
    reasons = []
    if "session" in kinds:
        spark = df.sparkSession
        parts["application"] = spark.conf.get("spark.app.id", None) or getattr(spark, "session_id", "")
        reasons.append("an RDD or cache of this application")
    if "content" in kinds:
        reasons.append("data held in the query plan")
    n_files = 0
    status: list[tuple[str, int, int]] = []
    if "files" in kinds:
        with spark_job("listing the DataFrame's input files with their sizes and modification times (its identity)"):
            status = _file_status(df.sparkSession, df.inputFiles())
        n_files = len(status)
        parts["files"] = hashlib.sha256(json.dumps(status).encode()).hexdigest()
        reasons.append(f"{n_files} input files with their sizes and modification times")
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    query = hashlib.sha256(_RANGE_SPLITS.sub("", _EXPR_ID.sub("", optimized)).strip().encode()).hexdigest()[:32]
    return DataIdentity(
        digest,
        True,
        ", ".join(reasons) or "the query plan",
        n_files,
        tuple(sorted(kinds)),
        query,
        tuple(status),
        local_rows="LocalRelation" in optimized or "LocalTableScan" in optimized,
        portable=portable is not None,
    )


_EXPR_ID = re.compile(r"#\d+L?\b")  # an attribute's expression id (x#12, y#3L): numbered per session
# A Range's partitions (spark.range's default: the application's parallelism): its rows do not depend on them.
_RANGE_SPLITS = re.compile(r",\s*splits=Some\(\d+\)")


def dataset_key(df, infos: Sequence[ColumnInfo], validation, seed: int, identity: DataIdentity | None = None) -> str:
    """Identifies a materialization: the data's identity (``data_identity``), the columns and the split.

    ``df`` (the prepared DataFrame: the input's columns as stored, the split flag) follows from the
    input, the columns, the split and this version's code: when the input's identity is the same in
    every JVM (``identity.portable``: files and a query whose text names it all) so is the key, and a
    later application reuses the data; else ``df``'s ``semanticHash`` is part of it (one JVM's)."""
    portable = identity is not None and identity.established and identity.portable
    spec = {
        "plan": "portable" if portable else df.semanticHash(),
        "identity": identity.digest if identity is not None else None,
        "columns": [i.to_dict() for i in infos],
        "validation": validation,
        "seed": seed if validation and not isinstance(validation, str) else None,
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]
