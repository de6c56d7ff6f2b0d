"""Damaged checkpoints in a real store, with real fits: a ``.keras`` cut short and a ``.json`` cut short
(a partial upload, a full disk on a filesystem without atomic renames, a manual copy). The fit that
resumes skips them by name, sets them aside (``checkpoints/damaged/``, never deleted) and trains the
epochs they held again."""

import logging
import os

from _helpers import xor_estimator, xor_frame


def _cut(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_damaged_newest_checkpoints_are_skipped_and_their_epochs_trained_again(spark, tmp_path, caplog):
    df = xor_frame(spark, 96)
    store_dir = tmp_path / "store"
    first = xor_estimator(str(store_dir), epochs=3, run_id="cut", verbose=0).fit(df)
    from hvd_spark import Store

    store = Store(str(store_dir))
    folder = store.checkpoints_path("cut")
    _cut(f"{folder}/epoch-0003.keras")  # today: "ValueError: File not found" on every later fit

    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        resumed = xor_estimator(str(store_dir), epochs=4, run_id="cut", verbose=0).fit(df)
    assert "the checkpoint of epoch 3" in caplog.text and "epoch-0003.keras holds" in caplog.text
    assert "resuming run 'cut' from epoch 2 of 4" in caplog.text
    history = resumed.getHistory()["loss"]
    assert len(history) == 4 and history[:2] == first.getHistory()["loss"][:2]
    summary = resumed.getFitSummary()
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch  # epochs 3 and 4 trained, once each
    assert [c.epoch for c in store.checkpoints("cut")] == [1, 2, 3, 4]
    aside = sorted(n.split("-", 1)[1] for n in os.listdir(f"{folder}/damaged"))
    assert aside == ["epoch-0003.json", "epoch-0003.keras"]  # kept for the user, out of the way

    caplog.clear()
    _cut(f"{folder}/epoch-0004.json")  # today: a bare JSONDecodeError naming no file
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        again = xor_estimator(str(store_dir), epochs=4, run_id="cut", verbose=0).fit(df)
    assert "epoch-0004.json does not read as JSON" in caplog.text
    assert "resuming run 'cut' from epoch 3 of 4" in caplog.text
    assert len(again.getHistory()["loss"]) == 4
    assert store.latest_checkpoint("cut").epoch == 4


class _SeenCheckpoints:
    """A callback recording, on rank 0 at each epoch's start, the epoch checkpoints in the store."""

    def __new__(cls, folder: str, out: str):
        import json

        import keras

        class Seen(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if os.environ.get("HVD_SPARK_RANK") == "0":
                    names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and "step" not in n)
                    with open(out, "a") as f:
                        f.write(json.dumps([epoch, names]) + "\n")

        return Seen()


def test_keep_checkpoints_keeps_the_newest_and_a_resume_still_works(spark, tmp_path):
    """Before: no retention, a run kept every epoch's checkpoint (4 after 4 epochs)."""
    import json
    import sys

    import cloudpickle

    from hvd_spark import HorovodEstimator, Store

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        df = xor_frame(spark, 96)
        store = Store(str(tmp_path / "store"))
        folder, seen = store.checkpoints_path("kept"), str(tmp_path / "seen.jsonl")
        os.makedirs(folder)
        est = xor_estimator(
            store, epochs=4, run_id="kept", verbose=0, keep_checkpoints=2, callbacks=[_SeenCheckpoints(folder, seen)]
        )
        first = est.fit(df)
        assert [c.epoch for c in store.checkpoints("kept")] == [3, 4]
        # pruned on rank 0 as training went, not only at the end
        during = [json.loads(line) for line in open(seen)]
        assert during[-1] == [3, ["epoch-0002.json", "epoch-0003.json"]], during
        est.save(str(tmp_path / "est"))
        loaded = HorovodEstimator.load(str(tmp_path / "est"))
        assert loaded.getOrDefault(loaded.keep_checkpoints) == 2
        resumed = loaded.copy({loaded.epochs: 6, loaded.callbacks: None}).fit(df)
        history = resumed.getHistory()["loss"]
        assert len(history) == 6 and history[:4] == first.getHistory()["loss"]
        assert [c.epoch for c in store.checkpoints("kept")] == [5, 6]
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
