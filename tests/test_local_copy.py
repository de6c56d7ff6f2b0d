"""The copy of a small DataFrame made on the driver (``spark.createDataFrame(pandas_df)``: a local
relation) is written by the driver, without a Spark job, and gives what the Spark job gives: the same
rows in each split, the same statistics, files the ranks read alike. Real Spark, real Parquet."""

import re

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from hvd_spark import Store
from hvd_spark._internal.common.specs import with_stored_names
from hvd_spark._internal.data import local_copy
from hvd_spark._internal.data import materialize as data_mod


def _frame(spark, n=300, bad=False):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 5)).astype("float32")
    ids = [list(map(int, rng.integers(-(2**40), 2**40, size=int(k)))) for k in rng.integers(1, 4, size=n)]
    w = rng.uniform(0.5, 2.0, size=n)
    if bad:
        x[7, 2] = np.nan
        w[11] = np.inf
    return spark.createDataFrame(
        pd.DataFrame(
            {
                "x": list(x),
                "ids": ids,
                "label": rng.integers(0, 4, size=n).astype("int64"),
                "y": rng.normal(size=n) * 10,
                "flag": rng.random(n) < 0.5,
                "word": [f"w{i % 7}" for i in range(n)],
                "w": w,
            }
        )
    )


def _copy(spark, df, store, key, local: bool, validation=0.3):
    features = [data_mod.column_info(df, c, "feature") for c in ("x", "ids", "flag", "word")]
    labels = [data_mod.column_info(df, c, "label") for c in ("label", "y")]
    features, labels = with_stored_names(features, labels)
    weight = data_mod.column_info(df, "w", "sample weight")
    prepared = data_mod.prepare(df, features, labels, weight, validation, seed=5)
    infos = [*features, *labels, weight]
    spark.conf.set("spark.hvd_spark.localCopyBytes", "67108864" if local else "0")
    try:
        assert (local_copy.local_rows(prepared, 64) is not None) == local
        meta = data_mod.materialize(prepared, store, key, infos, 64, 2, files=3)
    finally:
        spark.conf.unset("spark.hvd_spark.localCopyBytes")
    return meta


def _rows(meta, split):
    tables = [pq.read_table(url.removeprefix("file://")) for url, _ in meta[f"{split}_files"]]
    frame = pd.concat([t.to_pandas() for t in tables], ignore_index=True)
    frame = frame.map(lambda v: tuple(v) if isinstance(v, np.ndarray) else v)
    return frame.sort_values(list(frame.columns)).reset_index(drop=True), [t.schema for t in tables]


def _jobs(spark):
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))


@pytest.mark.parametrize("bad, validation", [(False, 0.3), (False, None), (True, 0.3)])
def test_driver_copy_equals_the_spark_job(spark, tmp_path, bad, validation):
    df = _frame(spark, bad=bad)
    store = Store(str(tmp_path))
    by_spark = _copy(spark, df, store, "spark", local=False, validation=validation)
    before = _jobs(spark)
    by_driver = _copy(spark, df, store, "driver", local=True, validation=validation)
    assert _jobs(spark) - before <= 1  # at most toArrow's collection: no writing stage
    files = by_driver["train_files"] + by_driver["val_files"]
    assert all(re.search(r"/(train|val)/part-\d{5}\.snappy\.parquet$", u) for u, _ in files), files  # the driver's
    assert all("=false/" in u or "=true/" in u for u, _ in by_spark["train_files"] + by_spark["val_files"])
    if bad:  # the rows a fit refuses, counted alike (the ranges of the other rows are not compared)
        for name, s in by_spark["stats"]["columns"].items():
            assert by_driver["stats"]["columns"][name]["bad"] == s["bad"], name
        assert by_driver["stats"]["columns"]["x"]["bad"] == 1 and by_driver["stats"]["columns"]["w"]["bad"] == 1
        return
    assert by_driver["stats"] == by_spark["stats"]
    assert by_driver["stats"]["columns"]["ids"]["max"] > 2**39  # 64-bit ids kept whole
    for split in ("train", "val") if validation else ("train",):
        assert by_driver[f"{split}_rows"] == by_spark[f"{split}_rows"] > 0
        (ours, our_schemas), (theirs, their_schemas) = _rows(by_driver, split), _rows(by_spark, split)
        pd.testing.assert_frame_equal(ours, theirs)
        assert {str(s.remove_metadata()) for s in our_schemas} <= {str(s.remove_metadata()) for s in their_schemas}
    assert len(by_driver["train_files"]) == 3 and (validation or by_driver["val_files"] == [])
    counts = [r for _, r in by_driver["train_files"]]
    assert max(counts) - min(counts) <= 1  # dealt round robin


def test_only_local_relations_within_the_bound(spark):
    df = _frame(spark, n=50)
    features, labels = with_stored_names(
        [data_mod.column_info(df, "x", "feature")], [data_mod.column_info(df, "y", "label")]
    )
    prepared = data_mod.prepare(df, features, labels, None, 0.2, seed=0)
    assert local_copy.local_rows(prepared, 24) == 50
    assert local_copy.local_rows(prepared.repartition(2), 24) is None  # a shuffle: Spark's job
    from pyspark.sql import functions as F

    ranged = spark.range(10).select(
        F.array(F.col("id").cast("float")).alias("x"), F.col("id").cast("double").alias("y")
    )
    assert local_copy.local_rows(data_mod.prepare(ranged, features, labels, None, 0.2, seed=0), 24) is None
    spark.conf.set("spark.hvd_spark.localCopyBytes", str(24 * 49))
    try:
        assert local_copy.local_rows(prepared, 24) is None  # more bytes than the bound
    finally:
        spark.conf.unset("spark.hvd_spark.localCopyBytes")
