"""The data plan (common/dataplan.py) and the rows it reads (rank/rows.py), on real Parquet files:
within an epoch no row is read twice and at most ``size - 1`` are left out, across commits,
restarts and resizes to any number of ranks; the rows left out rotate across epochs."""

import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common.dataplan import (
    Cursor,
    Unit,
    count,
    epoch_plan,
    layout_digest,
    merge,
    remaining,
    row_groups,
    shares,
    steps_for,
    used_after,
)
from hvd_spark._internal.rank.rows import ParquetSet, batched, epoch_batches, share_rows


def _units(sizes):
    return [Unit(0, g, n) for g, n in enumerate(sizes)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_orders_every_position_once_and_differs_by_epoch(shuffle):
    units = _units([7, 3, 11, 5, 9, 2])
    a, b = (epoch_plan(units, e, seed=3, shuffle=shuffle, window_rows=10) for e in (0, 1))
    assert a.rows == b.rows == 37
    assert sorted(a.order) == list(range(6)) and a.order != b.order
    assert a == epoch_plan(units, 0, seed=3, shuffle=shuffle, window_rows=10)  # a pure function
    for w in range(a.windows):
        held = sum(units[u].rows for u in a.window_units(w))
        assert held == a.starts[w + 1] - a.starts[w]
        if shuffle and w < a.windows - 1:
            assert held >= 10  # windows hold at least window_rows rows (the last one may hold fewer)
        perm = a.window_permutation(w)
        assert (perm is None) == (not shuffle)
        if perm is not None:
            assert sorted(perm.tolist()) == list(range(held))


def test_shares_are_equal_disjoint_and_leave_out_fewer_than_the_ranks():
    for total, size in [(37, 3), (36, 3), (5, 4), (100, 7)]:
        split = shares(total, [], size)
        seen = merge([i for mine in split.per_rank for i in mine])
        assert all(count(mine) == split.rows for mine in split.per_rank)
        assert count(seen) == split.rows * size == total - split.left_out
        assert 0 <= split.left_out < size


def _simulate_epoch(total, batch, sizes, rng):
    """An epoch run in attempts of the given sizes, each stopped after a random number of steps at a
    commit (the last runs to the end): every position read, per rank and attempt, as the trainer does."""
    used: list = []
    read: list[int] = []
    crowded = False  # an attempt had fewer rows left than ranks (each rank then gets one, some the same)
    for i, size in enumerate(sizes):
        crowded |= 0 < count(remaining(total, used)) < size
        split = shares(total, used, size)
        steps = steps_for(split.rows, batch)
        done = steps if i == len(sizes) - 1 else rng.randrange(0, steps + 1)
        rows_each = min(done * batch, split.rows)
        for mine in split.per_rank:
            left = rows_each
            for a, b in mine:
                n = min(left, b - a)
                read.extend(range(a, a + n))
                left -= n
        used = used_after(used, split, rows_each)
    return read, used, split, crowded


def test_restarts_and_resizes_read_each_position_at_most_once_and_skip_fewer_than_the_last_size():
    rng = random.Random(7)
    for _ in range(300):
        total, batch = rng.randrange(10, 400), rng.randrange(1, 9)
        sizes = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 5))]
        read, used, last, crowded = _simulate_epoch(total, batch, sizes, rng)
        if crowded:
            assert len(read) - len(set(read)) < max(sizes)
            continue
        assert len(read) == len(set(read)), "a position was read twice in one epoch"
        assert set(read) == {p for a, b in used for p in range(a, b)}  # the cursor records exactly what was read
        assert total - len(read) == last.left_out < sizes[-1]


def test_fewer_rows_than_ranks_give_every_rank_one():
    split = shares(10, [(0, 8)], 3)  # positions 8 and 9 left for 3 ranks
    assert split.per_rank == (((8, 9),), ((9, 10),), ((8, 9),)) and split.rows == 1 and split.left_out == 0


def test_cursor_round_trips_and_remaining_complements_it():
    cursor = Cursor(2, ((0, 5), (9, 12)), "abc", 3)
    assert Cursor.from_json(cursor.to_json()) == cursor
    assert remaining(15, cursor.used) == [(5, 9), (12, 15)]


def test_layout_changes_with_the_data_and_the_order():
    units = _units([4, 4])
    base = layout_digest(units, ["a"], seed=1, shuffle=True, window_rows=8)
    assert base == layout_digest(units, ["a"], seed=1, shuffle=True, window_rows=8)
    assert base != layout_digest(_units([4, 5]), ["a"], seed=1, shuffle=True, window_rows=8)
    assert base != layout_digest(units, ["a"], seed=2, shuffle=True, window_rows=8)
    assert base != layout_digest(units, ["b"], seed=1, shuffle=True, window_rows=8)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    """Two files of 5 and 3 row groups (uneven sizes): column ``id`` numbers the rows 0..N-1."""
    root = tmp_path_factory.mktemp("plan")
    paths, start = [], 0
    for name, groups in (("a", [7, 1, 5, 9, 4]), ("b", [6, 10, 3])):
        path = str(root / f"{name}.parquet")
        with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float32()))])) as w:
            for n in groups:
                ids = np.arange(start, start + n)
                w.write_table(
                    pa.table({"id": ids, "x": pa.array([[float(i), -float(i)] for i in ids], pa.list_(pa.float32()))})
                )
                start += n
        paths.append(path)
    units = row_groups(paths, lambda p: pq.ParquetFile(p).metadata)
    return paths, units, start


@pytest.mark.parametrize("shuffle", [True, False])
def test_reading_the_shares_of_an_epoch_gives_every_row_once(parquet, shuffle):
    paths, units, total = parquet
    data = ParquetSet(paths)
    plan = epoch_plan(units, 4, seed=11, shuffle=shuffle, window_rows=12)
    split = shares(total, [], 3)
    got = []
    for mine in split.per_rank:
        for chunk in share_rows(data, units, plan, mine, ["id", "x"]):
            assert np.array_equal(chunk["x"][:, 0], chunk["id"].astype(np.float32))  # columns stay aligned
            got.extend(chunk["id"].tolist())
    assert len(got) == len(set(got)) == total - split.left_out
    if shuffle:  # rows of different row groups share a window: the order is not the stored one
        assert got != sorted(got)


def test_rows_left_out_rotate_across_epochs(parquet):
    paths, units, total = parquet
    data = ParquetSet(paths)
    left_out = set()
    for epoch in range(6):
        plan = epoch_plan(units, epoch, seed=0, shuffle=False, window_rows=1)
        split = shares(total, [], 4)  # 45 rows on 4 ranks: one left out per epoch
        assert split.left_out == 1
        read = {int(i) for mine in split.per_rank for c in share_rows(data, units, plan, mine, ["id"]) for i in c["id"]}
        left_out.add(frozenset(set(range(total)) - read))
    assert len(left_out) == 6  # another row every epoch


def test_batches_are_exact_and_never_span_epochs(parquet):
    paths, units, total = parquet
    data = ParquetSet(paths)
    epochs = []
    for e in (0, 1):
        plan = epoch_plan(units, e, seed=5, shuffle=True, window_rows=8)
        split = shares(total, [], 2)
        epochs.append((plan, split.per_rank[1], split.rows))
    sizes = [len(b["id"]) for b in epoch_batches(data, units, epochs, ["id"], 5)]
    per_epoch = shares(total, [], 2).rows  # 24: batches 5,5,5,5,4 in each epoch
    assert sizes == [5, 5, 5, 5, per_epoch - 20] * 2


def test_a_fixed_number_of_rows_goes_over_the_share_again():
    chunks = [{"id": np.arange(3)}]
    out = list(batched(iter(chunks * 3), 2, limit=7))
    assert [b["id"].tolist() for b in out] == [[0, 1], [2, 0], [1, 2], [0]]


def test_the_rows_left_out_rotate_even_when_the_order_does_not_change():
    """One row group, no shuffle: the order is the same every epoch, the block left out is not."""
    left_out = []
    for epoch in range(5):
        split = shares(10, [], 3, epoch)  # one position of ten left out per epoch
        read = {p for mine in split.per_rank for a, b in mine for p in range(a, b)}
        assert len(read) == 9 and all(count(mine) == 3 for mine in split.per_rank)
        left_out.append(set(range(10)) - read)
    assert len({frozenset(s) for s in left_out}) == 5
