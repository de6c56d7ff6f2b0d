"""Store (local filesystem), checkpoints, leases and the column / tensor specs: pure Python."""

import os
import threading
import time

import pytest

from hvd_spark._internal.common.specs import (
    ColumnInfo,
    TensorSpec,
    assign_files,
    check_feature_lengths,
    steps_per_epoch,
    with_stored_names,
)
from hvd_spark._internal.data import leases
from hvd_spark._internal.data.store import Checkpoint, Store, checkpoint_names, validate_run_id


def test_tensor_spec_elements_and_dims():
    assert TensorSpec("x", (8, 8, 1), "float32").elements == 64
    assert TensorSpec("x", (8, 8, 1), "float32").dims == (8, 8, 1)
    assert TensorSpec("y", (), "float32").elements == 1
    unknown = TensorSpec("seq", (None, 4), "float32")
    assert unknown.elements is None
    with pytest.raises(ValueError, match="'seq' has an unknown dimension"):
        _ = unknown.dims
    assert TensorSpec.from_dict(unknown.to_dict()) == unknown


def test_stored_names_are_shared_by_a_column_used_twice():
    a, b = ColumnInfo("class label", "scalar", "int", True), ColumnInfo("x.y", "array", "float", False)
    feats, labels, weight = with_stored_names([b, a], [a], [None])
    assert [c.stored for c in feats] == ["c0", "c1"] and labels[0].stored == "c1" and weight == [None]


def test_feature_length_errors_name_the_column_and_the_input():
    spec = TensorSpec("pixels", (8, 8), "float32")
    check_feature_lengths("img", spec, 64, 64, "array")
    with pytest.raises(ValueError, match="'pixels' expects 64 values.*column 'img' has rows of length 63"):
        check_feature_lengths("img", spec, 63, 63, "array")
    with pytest.raises(ValueError, match="ragged arrays: rows have between 3 and 64"):
        check_feature_lengths("img", spec, 3, 64, "array")


def test_files_are_spread_by_rows_and_every_rank_gets_one():
    per_rank, load = assign_files([("a", 100), ("b", 60), ("c", 50), ("empty", 0)], 2)
    assert per_rank == [["a"], ["b", "c"]] and load == [100, 110]
    per_rank, load = assign_files([("only", 10)], 3)
    assert per_rank == [["only"]] * 3 and load == [10, 10, 10]
    assert steps_per_epoch(1000, 64, 2) == 8 and steps_per_epoch(1, 64, 4) == 1


def test_checkpoints_are_complete_and_ordered(tmp_path):
    store = Store(str(tmp_path))
    folder = store.checkpoints_path("run")
    store.files.makedirs(folder)
    for epoch in (10, 2, 3):
        model, meta = checkpoint_names(epoch)
        store.files.write_bytes(f"{folder}/{model}", b"model")
        if epoch != 3:  # epoch 3's metadata was never written: an incomplete checkpoint
            store.files.write_json(f"{folder}/{meta}", {"epoch": epoch, "model_bytes": 5})
    ckpts = store.checkpoints("run")
    assert [c.epoch for c in ckpts] == [2, 10]
    assert store.latest_checkpoint("run") == Checkpoint(10, f"{folder}/epoch-0010.keras", f"{folder}/epoch-0010.json")
    assert store.latest_checkpoint("other") is None


def test_exclusive_create_has_one_winner_among_threads(tmp_path):
    store = Store(str(tmp_path))
    path = store.files.path("data", "k", "_meta.json")
    wins, barrier = [], threading.Barrier(8)

    def attempt(i):
        barrier.wait()
        wins.append((i, store.files.create_exclusive_json(path, {"writer": i})))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    winners = [i for i, won in wins if won]
    assert len(wins) == 8 and len(winners) == 1
    assert store.files.read_json(path) == {"writer": winners[0]}
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp-")] == []


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _heartbeat(store, path):
    try:
        return store.files.read_json(path)["heartbeat"]
    except (FileNotFoundError, ValueError):  # being rewritten
        return None


def test_lease_is_live_while_held_and_gone_after(tmp_path):
    store = Store(str(tmp_path))
    folder = store.files.path("data", "k")
    store.files.makedirs(folder)
    path = f"{folder}/_writing-a.json"
    with leases.lease(store.files, path, heartbeat=0.2, attempt="a"):
        first = _heartbeat(store, path)
        _until(lambda: (_heartbeat(store, path) or 0) > first)  # it beats, and stays live
        live = leases.live_leases(store.files, folder, "_writing-", stale=5)
        assert [(d["attempt"], d["pid"]) for d in live] == [("a", os.getpid())]
        assert leases.live_leases(store.files, folder, "_writing-", stale=0) == []  # any age counts as stale
    assert leases.live_leases(store.files, folder, "_writing-", stale=5) == [] and os.listdir(folder) == []


@pytest.mark.parametrize("bad", ["", "../up", "a/b", "-x", "x" * 129, 7])
def test_run_id_is_checked(bad):
    with pytest.raises(ValueError, match="run_id must be"):
        validate_run_id(bad)


def test_exclusive_lease_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    from hvd_spark._internal.data.leases import LeaseHeldError

    store = Store(str(tmp_path / "store"))
    path = store.files.path("runs", "r", "_writer.json")
    with leases.exclusive_lease(store.files, path, heartbeat=0.1, stale=5, run_id="r") as lease:
        held = store.files.read_json(path)
        assert held["run_id"] == "r" and held["pid"] == os.getpid()
        with pytest.raises(LeaseHeldError) as err:
            with leases.exclusive_lease(store.files, path, heartbeat=0.1, stale=5):
                pass
        assert err.value.holder["token"] == held["token"]
        _until(lambda: (_heartbeat(store, path) or 0) > held["heartbeat"])  # it beats
        assert not lease.lost.is_set()
    assert not store.files.exists(path)  # released

    store.files.write_json(path, {"host": "h", "pid": 1, "heartbeat": time.time() - 60, "token": "dead"})
    with leases.exclusive_lease(store.files, path, heartbeat=0.1, stale=5) as lease:  # stale: taken over
        assert store.files.read_json(path)["token"] != "dead"
        store.files.write_json(path, {"host": "h2", "pid": 2, "heartbeat": time.time(), "token": "thief"})
        assert lease.lost.wait(10)  # the next heartbeat finds it taken
    assert store.files.read_json(path)["token"] == "thief"  # a lease it lost is neither rewritten nor removed
