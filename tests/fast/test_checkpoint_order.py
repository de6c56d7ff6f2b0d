"""What a fit rejected with DataChangedError removes: the checkpoints and commits written after the one
it resumed from, in training order (issue 47.5: the commits inside the epoch after an epoch checkpoint
sorted before it and were kept)."""

from hvd_spark._internal.data.store import Store, checkpoint_names, remove_checkpoints_after


def _run(tmp_path, positions):
    store = Store(str(tmp_path))
    folder = tmp_path / "runs" / "r" / "checkpoints"
    folder.mkdir(parents=True)
    for epoch, step in positions:
        model, meta = checkpoint_names(epoch, step)
        (folder / model).write_bytes(b"m")
        (folder / meta).write_text("{}")
    return store


def _left(store):
    return sorted((c.epoch, c.step) for c in store.checkpoints("r"))


def test_commits_after_the_epoch_checkpoint_resumed_from_are_removed(tmp_path):
    store = _run(tmp_path, [(1, 0), (1, 40), (2, 0), (2, 20), (2, 40), (3, 0)])
    resumed = next(c for c in store.checkpoints("r") if (c.epoch, c.step) == (2, 0))
    remove_checkpoints_after(store, "r", resumed)
    assert _left(store) == [(1, 0), (1, 40), (2, 0)]


def test_from_a_commit_the_commits_before_it_stay(tmp_path):
    store = _run(tmp_path, [(1, 0), (1, 20), (1, 40), (2, 0)])
    resumed = next(c for c in store.checkpoints("r") if (c.epoch, c.step) == (1, 20))
    remove_checkpoints_after(store, "r", resumed)
    assert _left(store) == [(1, 0), (1, 20)]


def test_a_fit_from_the_start_removes_everything(tmp_path):
    store = _run(tmp_path, [(0, 10), (1, 0)])
    remove_checkpoints_after(store, "r", None)
    assert _left(store) == []
