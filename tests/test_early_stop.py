"""An early stop with real ranks: EarlyStopping ends a fit of 12 epochs after epoch 2; the stop is
recorded with that epoch's checkpoint, a later fit of the run trains nothing and returns the model the
stopped fit returned (EarlyStopping's restored best weights), a restart after the stop trains nothing,
and a resize asked for at the stop is not taken (rank/cursor.py's ResizeCheck defers to the stop)."""

import json
import os
import sys

import cloudpickle
import keras
import numpy as np
from _helpers import xor_estimator, xor_frame

from hvd_spark import Store
from hvd_spark._internal.data.store import end_record_path

EPOCHS = 12


def _stopper(restore=True):
    # min_delta beyond any change: epoch 1 improves on +inf, epoch 2 does not, so training stops after it
    return keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=restore)


class FailOnceAtTrainEnd(keras.callbacks.Callback):
    """Rank 0 fails after the stopped epoch's checkpoint, before the fit's model: the first attempt only."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_train_end(self, logs=None):
        if os.environ.get("HVD_SPARK_RANK") == "0" and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise OSError("the store went away before the final model")


class AskToGrowAtStop(keras.callbacks.Callback):
    """Rank 0 writes the driver's resize marker at the epoch EarlyStopping stops (as GrowWatch does when
    slots return), before the ranks look for it."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_epoch_end(self, epoch, logs=None):
        if os.environ.get("HVD_SPARK_RANK") == "0" and self.model.stop_training:
            with open(self.marker, "w") as f:
                json.dump({"slots": 2}, f)


def _weights(path):
    return keras.models.load_model(path, compile=False).get_weights()


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_an_early_stop_holds_for_a_later_fit_and_a_restart(spark, tmp_path):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    first = xor_estimator(store, epochs=EPOCHS, run_id="stopped", callbacks=[_stopper()]).fit(df)
    assert len(first.getHistory()["loss"]) == 2
    ckpts = Store(store).checkpoints("stopped")
    assert [c.epoch for c in ckpts] == [1, 2]
    meta = json.loads(open(ckpts[-1].meta_path).read())
    assert meta["stopped"] == {"epoch": 2, "epochs": EPOCHS, "by": "EarlyStopping"}
    end = json.loads(open(end_record_path(Store(store), "stopped", 2)).read())
    returned = first.getModel().get_weights()
    assert _same(returned, _weights(ckpts[0].model_path))  # the restored best: epoch 1's weights
    assert not _same(returned, _weights(ckpts[1].model_path))
    assert end["model"].startswith("models/") and end["epoch"] == 2

    again = xor_estimator(store, epochs=EPOCHS, run_id="stopped", callbacks=[_stopper()]).fit(df)
    assert again.getFitSummary() is None  # no training
    assert len(again.getHistory()["loss"]) == 2 and _same(again.getModel().get_weights(), returned)
    assert [c.epoch for c in Store(store).checkpoints("stopped")] == [1, 2]

    failing = [_stopper(), FailOnceAtTrainEnd(str(tmp_path / "failed"))]
    model = xor_estimator(store, epochs=EPOCHS, run_id="restarted", callbacks=failing, max_restarts=1).fit(df)
    assert os.path.exists(tmp_path / "failed")
    assert model.getFitSummary().restarts == 1
    assert len(model.getHistory()["loss"]) == 2
    ckpts = Store(store).checkpoints("restarted")
    assert [c.epoch for c in ckpts] == [1, 2]
    # the fit failed before its model: the restart returns EarlyStopping's best, epoch 1's checkpoint
    assert _same(model.getModel().get_weights(), _weights(ckpts[0].model_path))


class AskToGrowAt(keras.callbacks.Callback):
    """Rank 0 writes the driver's resize marker at the end of ``epoch`` (0-based), once."""

    def __init__(self, marker, epoch):
        super().__init__()
        self.marker, self.epoch = marker, epoch

    def on_epoch_end(self, epoch, logs=None):
        if os.environ.get("HVD_SPARK_RANK") == "0" and epoch == self.epoch:
            with open(self.marker, "w") as f:
                json.dump({"slots": 2}, f)


def test_early_stoppings_state_survives_a_resize_and_a_finished_run_returns_its_restored_model(spark, tmp_path):
    """EarlyStopping(patience=2) whose best is epoch 1: one process stops after epoch 3 and restores epoch
    1's weights. A resize after epoch 2 used to start a fresh EarlyStopping (5 epochs, epoch 3's weights)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    marker = os.path.join(store, "runs", "grown", "_resize.json")
    patient = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9, restore_best_weights=True)
    est = xor_estimator(
        store,
        epochs=EPOCHS,
        run_id="grown",
        callbacks=[patient, AskToGrowAt(marker, 1)],
        min_num_proc=1,
        max_num_proc=2,
        max_restarts=1,
    )
    model = est.fit(df)
    assert [r.kind for r in model.getFitSummary().recoveries] == ["restart"]  # the resize happened
    assert len(model.getHistory()["loss"]) == 3
    ckpts = Store(store).checkpoints("grown")
    assert [c.epoch for c in ckpts] == [1, 2, 3]
    meta = json.loads(open(ckpts[-1].meta_path).read())
    assert meta["callbacks"][0]["state"]["wait"] == 2 and meta["callbacks"][0]["state"]["best_epoch"] == 0
    assert _same(model.getModel().get_weights(), _weights(ckpts[0].model_path))

    # A run that trained all its epochs, fitted again: the model its fit returned (restored), not epoch 3's.
    keep = keras.callbacks.EarlyStopping(monitor="loss", patience=9, min_delta=1e9, restore_best_weights=True)
    first = xor_estimator(store, epochs=3, run_id="finished", callbacks=[keep]).fit(df)
    again = xor_estimator(store, epochs=3, run_id="finished", callbacks=[keep]).fit(df)
    ckpts = Store(store).checkpoints("finished")
    assert _same(first.getModel().get_weights(), _weights(ckpts[0].model_path))
    assert again.getFitSummary() is None and _same(again.getModel().get_weights(), first.getModel().get_weights())


def test_a_resize_at_the_stop_is_not_taken(spark, tmp_path):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    marker = os.path.join(store, "runs", "grow", "_resize.json")
    est = xor_estimator(
        store,
        epochs=EPOCHS,
        run_id="grow",
        callbacks=[_stopper(), AskToGrowAtStop(marker)],
        min_num_proc=1,
        max_num_proc=2,
        max_restarts=1,
    )
    model = est.fit(df)
    assert len(model.getHistory()["loss"]) == 2
    assert model.getFitSummary().recoveries == ()
    assert [c.epoch for c in Store(store).checkpoints("grow")] == [1, 2]
