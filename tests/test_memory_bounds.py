"""The copy's memory does not grow with the data: its Parquet writers (Spark's, in the JVM, and the
store's, in Python workers) hold one row group at a time in memory, and the ranks read a row group
whole, so row groups are cut by bytes (``HVD_SPARK_ROW_GROUP_BYTES`` / ``spark.hvd_spark.rowGroupBytes``,
64 MB by default), never sized by the data. Row groups of 256 MB ran the 1 GiB heap of
``hvd_spark.local_session`` out of memory copying 20M rows (2.5 GB).

The reader's side (files read, not memory-mapped) is in tests/fast/test_reader_memory.py."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from hvd_spark import Store
from hvd_spark._internal.common.specs import with_stored_names
from hvd_spark._internal.data import materialize as data_mod

ROWS = 40_000
WIDTH = 32  # float32 values per row: about 5 MB of Parquet in all
GROUP_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def frame(spark):
    from pyspark.sql import functions as F

    return spark.range(ROWS, numPartitions=4).select(
        F.array(*[F.sin(F.col("id") * (k + 1)).cast("float") for k in range(WIDTH)]).alias("x"),
        F.cos("id").alias("y"),
    )


@pytest.mark.parametrize("writer", ["spark", "store"])
def test_copy_row_groups_are_cut_by_bytes(spark, frame, tmp_path, writer):
    features, labels = with_stored_names(
        [data_mod.column_info(frame, "x", "feature")], [data_mod.column_info(frame, "y", "label")]
    )
    prepared = data_mod.prepare(frame, features, labels, None, 0.1, seed=0)
    store = Store(str(tmp_path), parquet_writer=writer)
    spark.conf.set("spark.hvd_spark.rowGroupBytes", str(GROUP_BYTES))
    try:
        meta = data_mod.materialize(prepared, store, f"bounded-{writer}", features + labels, (WIDTH + 1) * 4, 2)
    finally:
        spark.conf.unset("spark.hvd_spark.rowGroupBytes")
    assert meta["train_rows"] + meta["val_rows"] == ROWS
    groups = []
    for url, rows in meta["train_files"] + meta["val_files"]:
        md = pq.ParquetFile(url.removeprefix("file://")).metadata
        assert md.num_rows == rows
        groups += [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
    total = sum(groups)
    assert total > 12 * GROUP_BYTES  # the data is many row groups large
    # Each row group near the bound, none sized by the data (each file holds about half of it). The
    # bound is on the bytes a writer holds (Spark's: its buffered pages, checked every few hundred rows;
    # the store's: 4 bytes a value); Parquet's uncompressed size adds the list's levels (about 1.6x).
    assert max(groups) <= 2 * GROUP_BYTES, (sorted(groups)[-3:], GROUP_BYTES)
    assert len(groups) >= total / (2 * GROUP_BYTES)
    assert np.median(groups) >= GROUP_BYTES / 4  # not cut needlessly small either
