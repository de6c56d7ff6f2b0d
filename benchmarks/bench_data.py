"""Data path: rows/s that one rank's reader feeds into tf.data (hvd_spark's rank_dataset, batches
of 256), with the Arrow reader (the default) and with Petastorm where it can run (pyarrow 12),
against pyarrow reading the same Parquet files directly in the same run: iter_batches of 256 rows
(the target's baseline: what a hand-written pyarrow loop feeding a model would do) and each file
read whole with its list column reshaped (no batches at all). Both baselines run serially; the
reader overlaps reading (a prefetch thread) with tf.data's rebatching.

    python -m benchmarks.bench_data [--quick]
"""

import os
import tempfile
import time

import numpy as np

from benchmarks.common import cli, stats, write


def make_files(folder, rows, width, files=4):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    per = rows // files
    paths = []
    for i in range(files):
        feats = rng.normal(size=(per, width)).astype("float32")
        offsets = pa.array(np.arange(0, per * width + 1, width, dtype=np.int32))
        table = pa.table(
            {"features": pa.ListArray.from_arrays(offsets, pa.array(feats.ravel())), "label": rng.integers(0, 10, per)}
        )
        path = os.path.join(folder, f"part-{i}.parquet")
        pq.write_table(table, path, row_group_size=per)
        paths.append(path)
    return paths, per * files


def reader_rate(reader, paths, rows, width, batch):
    from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec
    from hvd_spark._internal.rank.reader import rank_dataset

    feats = [ColumnInfo("features", "array", "float", False, stored="features")]
    labels = [ColumnInfo("label", "scalar", "bigint", True, stored="label")]
    with rank_dataset(
        ["file://" + p for p in paths],
        features=feats,
        labels=labels,
        weight=None,
        inputs=[TensorSpec("x", (width,), "float32")],
        outputs=[TensorSpec("y", (10,), "float32")],
        batch_size=batch,
        shuffle=False,
        shuffle_buffer_size=1,
        seed=0,
        reader=reader,
    ) as ds:
        steps = rows // batch
        it = iter(ds)
        next(it)  # start-up (reader threads, first row group) is not counted
        t0 = time.perf_counter()
        for _ in range(steps):
            x, _ = next(it)
        return steps * batch / (time.perf_counter() - t0)


def pyarrow_rate(paths, rows, batch):
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    n = 0
    for p in paths:
        for b in pq.ParquetFile(p).iter_batches(batch_size=batch):
            col = b.column(0)
            _ = np.asarray(col.flatten()).reshape(len(b), -1)
            n += len(b)
    return n / (time.perf_counter() - t0)


def pyarrow_whole_file_rate(paths):
    """Each file read whole into one table, its list column reshaped (no batching at all)."""
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    n = 0
    for p in paths:
        t = pq.read_table(p)
        col = t.column(0).combine_chunks()
        _ = np.asarray(col.flatten()).reshape(len(t), -1)
        n += len(t)
    return n / (time.perf_counter() - t0)


def main(quick: bool):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows, width = (100_000 if quick else 400_000), 64
    repeats = 3 if quick else 5
    from hvd_spark._internal.rank.reader import petastorm_available

    readers = ["arrow"] + (["petastorm"] if petastorm_available() else [])
    with tempfile.TemporaryDirectory() as d:
        paths, rows = make_files(d, rows, width)
        rates = {"pyarrow": [], "pyarrow_whole_file": [], **{r: [] for r in readers}}
        for _ in range(repeats):  # interleaved, so drift hits all alike
            rates["pyarrow"].append(pyarrow_rate(paths, rows, 256))
            rates["pyarrow_whole_file"].append(pyarrow_whole_file_rate(paths))
            for r in readers:
                rates[r].append(reader_rate(r, paths, rows, width, 256))
    pa_s = stats(rates["pyarrow"])
    whole = stats(rates["pyarrow_whole_file"])
    data = {
        "rows": rows,
        "values_per_row": width + 1,
        "batch": 256,
        "pyarrow_rows_per_s": pa_s,
        "pyarrow_whole_file_rows_per_s": whole,
    }
    for r in readers:
        data[f"{r}_tfdata_rows_per_s"] = stats(rates[r])
        data[f"ratio_{r}_over_pyarrow"] = data[f"{r}_tfdata_rows_per_s"]["median"] / pa_s["median"]
        data[f"ratio_{r}_over_pyarrow_whole_file"] = data[f"{r}_tfdata_rows_per_s"]["median"] / whole["median"]
    print(write("data_path", data))
    return data


if __name__ == "__main__":
    cli(main)
