"""The in-place scan of a Parquet table (``inplace.scan_table``, the statistics and row counts a fit
reading in place needs before training), side by side in one run, on tables of 1M and 5M rows:

* ``values``: every statistic from the row groups' values in one Spark job (``use_footers=False``: the
  scan as it was before footers were used), the baseline;
* ``cold``: the scan as a fit runs it on a table never scanned (footers where they give a statistic,
  the values of the other columns);
* ``kept``: a later application on the unchanged files (the scan kept in the store: no pass).

Two tables per size: the protocol of issue 38 (a 32-float array feature, a binary integer label:
the array's values must be read) and an integer table (16 int features as a group, an int label:
footers alone). Medians of 3 runs (2 with ``--quick``), the modes alternated within each.

    python -m benchmarks.bench_scan [--quick]
"""

import os
import statistics
import tempfile
import time

from benchmarks.common import cli, session, write


def _tables(spark, root: str, rows: int) -> dict[str, str]:
    from pyspark.sql import functions as F

    base = spark.range(rows, numPartitions=8)
    out = {}
    path = os.path.join(root, f"array-{rows}")
    base.select(
        F.array(*[F.sin(F.col("id") * (k + 1)).cast("float") for k in range(32)]).alias("x"),
        (F.col("id") % 2).cast("int").alias("y"),
    ).write.mode("overwrite").parquet(path)
    out["array"] = path
    path = os.path.join(root, f"ints-{rows}")
    base.select(
        *[((F.col("id") * (k + 7)) % 1000).cast("int").alias(f"i{k}") for k in range(16)],
        (F.col("id") % 2).cast("int").alias("y"),
    ).write.mode("overwrite").parquet(path)
    out["ints"] = path
    return out


def _source(spark, path: str, kind: str):
    from hvd_spark._internal.common import sources
    from hvd_spark._internal.data import inplace

    df = spark.read.parquet(path)
    names = df.columns
    scan = inplace.read_plan(df, names).scan
    assert scan is not None
    if kind == "array":
        columns = (sources.SourceColumn("x", "array", ("x",), "float32", "x"),)
    else:
        feats = tuple(n for n in names if n != "y")
        columns = (sources.SourceColumn("f", "group", feats, "int32", "features"),)
    columns += (sources.SourceColumn("y", "scalar", ("y",), "int32", "y"),)
    status = tuple(inplace.list_status(scan.files, None))
    return scan, sources.TableSource(columns, ("fraction", 0.1, 0), status, None, scan.root)


def _timed(spark, store, scan, source, mode: str) -> float:
    from hvd_spark._internal.data import inplace

    t0 = time.time()
    inplace.scan_table(
        spark, store, scan, source, reuse=mode == "kept", check=lambda s: None, slots=2, use_footers=mode != "values"
    )
    return time.time() - t0


def main(quick: bool) -> None:
    from hvd_spark import Store

    repeats = 2 if quick else 3
    spark = session("local[2]")
    sizes = [200_000] if quick else [1_000_000, 5_000_000]
    results = []
    with tempfile.TemporaryDirectory() as root:
        for rows in sizes:
            for kind, path in _tables(spark, root, rows).items():
                scan, source = _source(spark, path, kind)
                store = Store(os.path.join(root, f"store-{kind}-{rows}"))
                _timed(spark, store, scan, source, "kept")  # fills the store's kept scan (and warms the JVM)
                times: dict[str, list[float]] = {"values": [], "cold": [], "kept": []}
                for _ in range(repeats):
                    for mode in times:
                        times[mode].append(_timed(spark, store, scan, source, mode))
                med = {m: statistics.median(v) for m, v in times.items()}
                row = {
                    "rows": rows,
                    "table": kind,
                    "files": len(scan.files),
                    **{f"{m}_s": round(v, 3) for m, v in med.items()},
                    "runs": {m: [round(x, 3) for x in v] for m, v in times.items()},
                    "cold_over_values": round(med["cold"] / med["values"], 3),
                    "kept_over_values": round(med["kept"] / med["values"], 4),
                }
                print(row)
                results.append(row)
    spark.stop()
    write("scan", {"results": results, "repeats": repeats})


if __name__ == "__main__":
    cli(main)
