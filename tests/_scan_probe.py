"""What a driver finds for a Parquet table in a store: the in-place scan (how many Spark jobs it ran,
its statistics and row groups) and the copy's dataset key. tests/test_inplace.py calls :func:`probe` in
its own session and runs this file as a second driver process (its own Spark JVM) to compare.

    python tests/_scan_probe.py <table> <store> <spark local dir>   # prints one JSON line
"""

import json
import sys
import time
import uuid


def probe(spark, table: str, store: str, reuse: bool = True) -> dict:
    from hvd_spark import Store
    from hvd_spark._internal.common import sources
    from hvd_spark._internal.data import identity, inplace

    df = spark.read.parquet(table).select("x", "y")
    scan = inplace.read_plan(df, ["x", "y"]).scan
    assert scan is not None
    status = tuple(inplace.list_status(scan.files, None))
    columns = (
        sources.SourceColumn("x", "array", ("x",), "float32", "x"),
        sources.SourceColumn("y", "scalar", ("y",), "int32", "y"),
    )
    source = sources.TableSource(columns, ("fraction", 0.25, 3), status, None, scan.root)
    sc = spark.sparkContext
    group = f"probe-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "the scan probe")
    t0 = time.time()
    try:
        meta = inplace.scan_table(spark, Store(store), scan, source, reuse=reuse, check=lambda s: None, slots=2)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    seconds = time.time() - t0
    ident = identity.data_identity(df)
    return {
        "jobs": len(sc.statusTracker().getJobIdsForGroup(group)),
        "seconds": seconds,
        "stats": meta["stats"],
        "units": meta["units"],
        "key": identity.dataset_key(df, [], 0.25, 3, ident),
        "digest": ident.digest,
        "portable": ident.portable,
        "semantic": df.semanticHash(),  # the JVM's own hash (differs from one JVM to the next for files)
    }


if __name__ == "__main__":
    import hvd_spark

    session = hvd_spark.local_session("local[2]", app_name="scan-probe", conf={"spark.local.dir": sys.argv[3]})
    session.sparkContext.setLogLevel("ERROR")
    try:
        print(json.dumps(probe(session, sys.argv[1], sys.argv[2])))
    finally:
        session.stop()
