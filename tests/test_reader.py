"""The rank-side readers on real Parquet files, without Spark: rows, shapes, seeded shuffling, and the
Arrow reader against Petastorm (where Petastorm can run: the pyarrow-12 line)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec
from hvd_spark._internal.rank.reader import (
    arrow_batches,
    column_values,
    rank_dataset,
    to_model_inputs,
)


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory):
    """3 files, 4 row groups of 25 rows each: 'c0' list<float> of 6 values, 'c1' int label, 'c2' float weight."""
    d = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    files, offset = [], 0
    for i in range(3):
        n = 100
        x = rng.normal(size=(n, 6)).astype("float32")
        x[:, 0] = np.arange(offset, offset + n)  # a row id, to compare multisets of rows
        table = pa.table(
            {
                "c0": pa.array(list(x), type=pa.list_(pa.float32())),
                "c1": pa.array(np.arange(offset, offset + n) % 3, type=pa.int32()),
                "c2": pa.array(np.ones(n), type=pa.float64()),
            }
        )
        path = str(d / f"part-{i}.parquet")
        pq.write_table(table, path, row_group_size=25)
        files.append(path)
        offset += n
    return files


def _ids(batches):
    return np.concatenate([b["c0"][:, 0] for b in batches]).astype(int)


def test_one_pass_reads_every_row_once_as_2d_arrays(parquet_files):
    batches = list(arrow_batches(parquet_files, ["c0", "c1"], shuffle=False, seed=0, passes=1))
    assert len(batches) == 12 and all(b["c0"].shape == (25, 6) and b["c1"].shape == (25,) for b in batches)
    assert batches[0]["c0"].dtype == np.float32 and batches[0]["c1"].dtype == np.int32
    np.testing.assert_array_equal(_ids(batches), np.arange(300))
    # Labels stay attached to their rows.
    assert all((b["c1"] == b["c0"][:, 0].astype(int) % 3).all() for b in batches)


def test_shuffling_is_seeded_per_rank_and_per_pass(parquet_files):
    def order(seed, passes=2):
        return _ids(list(arrow_batches(parquet_files, ["c0", "c1"], shuffle=True, seed=seed, passes=passes)))

    a, b, c = order(1), order(1), order(2)
    np.testing.assert_array_equal(a, b)  # same seed: same order
    assert not np.array_equal(a, c)  # another rank's seed: another order
    first, second = a[:300], a[300:]
    assert not np.array_equal(first, second)  # each pass reshuffles
    np.testing.assert_array_equal(np.sort(first), np.arange(300))  # each pass: every row exactly once
    np.testing.assert_array_equal(np.sort(second), np.arange(300))
    batches = list(arrow_batches(parquet_files, ["c0", "c1"], shuffle=True, seed=1, passes=1))
    assert all((bt["c1"] == bt["c0"][:, 0].astype(int) % 3).all() for bt in batches)  # rows move whole


def test_a_shuffle_window_mixes_row_groups_within_each_pass(parquet_files):
    """Rows of different row groups share chunks (so batches), and no window spans two passes: each
    pass is still a permutation of all rows. Before: a buffer of whole batches larger than a pass
    mixed passes, so an epoch saw some rows twice and others not at all."""
    chunks = list(arrow_batches(parquet_files, ["c0", "c1"], shuffle=True, seed=4, passes=2, window_rows=100))
    ids = _ids(chunks)
    np.testing.assert_array_equal(np.sort(ids[:300]), np.arange(300))
    np.testing.assert_array_equal(np.sort(ids[300:]), np.arange(300))
    assert [len(c["c1"]) for c in chunks] == [100] * 6  # 12 row groups of 25 a pass: windows of 4
    assert len({int(v) // 25 for v in _ids(chunks[:1])}) > 1  # rows of several row groups in one chunk
    assert all((c["c1"] == c["c0"][:, 0].astype(int) % 3).all() for c in chunks)  # rows move whole


def test_column_values_of_sliced_and_chunked_lists():
    arr = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], type=pa.list_(pa.float32()))
    np.testing.assert_array_equal(column_values(arr.slice(1, 2)), [[3, 4], [5, 6]])
    chunked = pa.chunked_array([arr.slice(0, 1), arr.slice(2, 2)])
    np.testing.assert_array_equal(column_values(chunked), [[1, 2], [5, 6], [7, 8]])
    assert column_values(pa.array([], type=pa.list_(pa.float32()))).shape == (0, 0)


def test_model_inputs_from_pandas_objects_and_arrow_agree():
    """Array columns reach the model as N-D arrays, whether pandas (object arrays of per-row arrays, nested
    for list<list<>>) or Arrow gives them; a row of the wrong size is an error, not a silent reshape."""
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    flat = pa.array(list(x.reshape(4, 6)), type=pa.list_(pa.float32()))
    nested = pa.array([[list(r) for r in m] for m in x], type=pa.list_(pa.list_(pa.float32())))
    spec = [TensorSpec("x", (2, 3), "float32")]
    for col in (flat, nested):
        np.testing.assert_array_equal(to_model_inputs([col.to_pandas().to_numpy()], spec), x)
    np.testing.assert_array_equal(to_model_inputs([flat], spec), x)
    assert to_model_inputs([flat.to_pandas().to_numpy()[:0]], spec).shape == (0, 2, 3)
    ragged = pa.array([[1.0] * 6, [1.0] * 5], type=pa.list_(pa.float32())).to_pandas().to_numpy()
    with pytest.raises(ValueError, match="6 values per row"):
        to_model_inputs([ragged], spec)


def _dataset_rows(files, reader, rows):
    feats = [ColumnInfo("x", "array", "float", False, stored="c0")]
    labels = [ColumnInfo("y", "scalar", "int", True, stored="c1")]
    weight = ColumnInfo("w", "scalar", "double", False, stored="c2")
    with rank_dataset(
        files,
        features=feats,
        labels=labels,
        weight=weight,
        inputs=[TensorSpec("x", (2, 3), "float32")],
        outputs=[TensorSpec("y", (3,), "float32")],
        batch_size=16,
        shuffle=True,
        shuffle_buffer_size=64,
        seed=5,
        reader=reader,
    ) as ds:
        got = []
        for x, y, w in ds.take(rows // 16 + 1):
            assert x.shape[1:] == (2, 3) and y.shape.rank == 1 and w.dtype.name == "float32"
            got.append(x.numpy()[:, 0, 0])
    return np.concatenate(got).astype(int)[:rows]


def test_rank_dataset_batches_shapes_and_covers_rows(parquet_files):
    ids = _dataset_rows(parquet_files, "arrow", 300)
    assert len(ids) == 300
    # Within one pass (plus the shuffle buffer's reach) nearly every row is seen once.
    assert len(set(ids)) >= 250


@pytest.mark.petastorm
def test_arrow_and_petastorm_give_the_same_rows(parquet_files):
    from hvd_spark._internal.rank.reader import _petastorm_source

    names = ["c0", "c1"]
    arrow = sorted(
        map(
            tuple,
            np.concatenate(
                [
                    np.column_stack([b["c0"], b["c1"]])
                    for b in arrow_batches(parquet_files, names, shuffle=True, seed=3, passes=1)
                ]
            ).tolist(),
        )
    )
    with _petastorm_source([f"file://{f}" for f in parquet_files], names, shuffle=True, seed=3, workers=1) as ds:
        rows = []
        for batch in ds.take(12):
            rows.append(np.column_stack([batch["c0"].numpy(), batch["c1"].numpy()]))
    petastorm = sorted(map(tuple, np.concatenate(rows).tolist()))
    assert petastorm == arrow


def test_arrow_reader_reads_through_fsspec_filesystems(parquet_files):
    """A store that is not a local path (here fsspec's in-memory filesystem; s3:// goes the same way)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for i, path in enumerate(parquet_files[:2]):
        with open(path, "rb") as src, fs.open(f"/hvd_spark_reader_test/part-{i}.parquet", "wb") as dst:
            dst.write(src.read())
        urls.append(f"memory://hvd_spark_reader_test/part-{i}.parquet")
    local = _ids(list(arrow_batches(parquet_files[:2], ["c0"], shuffle=False, seed=0, passes=1)))
    remote = _ids(list(arrow_batches(urls, ["c0"], shuffle=False, seed=0, passes=1, storage_options={})))
    np.testing.assert_array_equal(remote, local)
