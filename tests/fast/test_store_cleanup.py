"""Store.cleanup after fits: the data a fit read is removable once its reading lease ended (before: a
reused dataset counted as in use for a minute after its fit ended, and cleanup(older_than=0) left its
files), never while a lease is live or a fit that just reused it is about to take one."""

import json
import os
import time
from types import SimpleNamespace

from hvd_spark import Store
from hvd_spark._internal.data.fit_data import removed_after
from hvd_spark._internal.data.store import DATA_META, DATA_USED


def _dataset(root, key: str) -> None:
    folder = root / "data" / key
    (folder / "0" / "train").mkdir(parents=True)
    (folder / "0" / "train" / "part-0.parquet").write_bytes(b"x" * 100)
    (folder / DATA_META).write_text(json.dumps({"created": time.time() - 10, "train_rows": 1}))


def _reused(root, key: str) -> None:
    """What a fit that reuses the data writes when it decides to (materialize.py, inplace.py)."""
    (root / "data" / key / DATA_USED).write_text(json.dumps({"time": time.time()}))


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root / "data") for f in fs)


def test_cleanup_removes_data_once_its_fit_ended_never_under_a_lease(tmp_path):
    store = Store(str(tmp_path))
    _dataset(tmp_path, "k1")
    _reused(tmp_path, "k1")  # a fit reused it a moment ago: its reading lease comes next
    assert store.cleanup(older_than=0, runs=True) == []
    with removed_after(store, SimpleNamespace(key="k1", ephemeral=False)):
        assert store.datasets()[0]["in_use"]
        assert store.cleanup(older_than=0, runs=True) == []  # a live reading lease
    assert not store.datasets()[0]["in_use"]
    assert store.cleanup(older_than=0, runs=True) == [store.files.url(str(tmp_path / "data" / "k1"))]
    assert _files(tmp_path) == []


def test_a_reuse_during_another_fit_s_lease_stays_protected(tmp_path):
    store = Store(str(tmp_path))
    _dataset(tmp_path, "k2")
    with removed_after(store, SimpleNamespace(key="k2", ephemeral=False)):
        time.sleep(0.01)
        _reused(tmp_path, "k2")  # a second fit reuses it while the first trains
    assert store.datasets()[0]["in_use"]  # the second fit's lease comes: not removed
    assert store.cleanup(older_than=0) == []
    assert len(_files(tmp_path)) == 3


def _checkpoint(root, run: str, epoch: int, step: int = 0, size: int = 10) -> None:
    from hvd_spark._internal.data.store import checkpoint_names

    folder = root / "runs" / run / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    model, meta = checkpoint_names(epoch, step)
    (folder / model).write_bytes(b"k" * size)
    (folder / meta).write_text(json.dumps({"history": [], "model_bytes": 10}))


def test_prune_checkpoints_keeps_the_newest_the_protected_one_and_the_commits(tmp_path):
    from hvd_spark._internal.data.store import prune_checkpoints

    store = Store(str(tmp_path))
    for e in range(1, 6):
        _checkpoint(tmp_path, "r", e)
    _checkpoint(tmp_path, "r", 5, step=3)  # a commit inside epoch 6
    removed = prune_checkpoints(store, "r", 2, also=1)
    assert [c.epoch for c in removed] == [2, 3]
    assert [(c.epoch, c.step) for c in store.checkpoints("r")] == [(1, 0), (4, 0), (5, 0), (5, 3)]
    assert prune_checkpoints(store, "r", 1) and [c.epoch for c in store.checkpoints("r")] == [5, 5]
    _checkpoint(tmp_path, "r", 6, size=4)  # the newest is cut short: nothing goes, a resume needs epoch 5
    assert prune_checkpoints(store, "r", 1) == []
    assert store.latest_checkpoint("r").epoch == 5
