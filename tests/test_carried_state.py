"""rank/carried.py with plain Keras in this process (no ranks): EarlyStopping's state carried across
the ``model.fit`` calls of one attempt (the rest of an epoch resumed from a commit, then whole epochs),
its restore of the best weights undone only when training goes on, and its state recorded and put back
as a new attempt does."""

import json

import keras
import numpy as np

from hvd_spark._internal.rank.carried import CarriedState, capture


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0]], "float32"))


def _fit(model, callbacks, carried, segments):
    x, y = _data()
    weights_after = []
    for i, (first, end) in enumerate(segments):
        carried.final = i == len(segments) - 1
        model.fit(x, y, batch_size=16, epochs=end, initial_epoch=first, verbose=0, shuffle=False, callbacks=callbacks)
        weights_after.append(model.get_weights())
        if model.stop_training:
            break
    return weights_after


def test_state_carries_across_fit_calls_and_the_restore_waits_for_the_end():
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=1e9, restore_best_weights=True)
    model = _model()
    carried = CarriedState([stopper], None, lambda epoch: None)
    callbacks = [carried.guard, stopper, carried]
    snapshots = []

    class Snap(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append(self.model.get_weights())

    callbacks.append(Snap())
    after = _fit(model, callbacks, carried, [(0, 1), (1, 10)])
    # One process: epoch 1 is the best (min_delta beyond any change), patience 2 stops after epoch 3.
    assert len(snapshots) == 3 and stopper.stopped_epoch == 2 and stopper.wait == 2
    assert all(np.array_equal(a, b) for a, b in zip(after[0], snapshots[0]))  # not restored mid-attempt
    assert all(np.array_equal(a, b) for a, b in zip(after[-1], snapshots[0]))  # restored at the end


def test_a_stop_in_a_segment_that_is_not_the_last_keeps_the_restored_weights():
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)
    model = _model()
    carried = CarriedState([stopper], None, lambda epoch: None)
    snapshots = []

    class Snap(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append(self.model.get_weights())

    after = _fit(model, [carried.guard, stopper, carried, Snap()], carried, [(0, 2), (2, 10)])
    assert len(after) == 1 and model.stop_training and len(snapshots) == 2
    assert all(np.array_equal(a, b) for a, b in zip(after[0], snapshots[0]))  # epoch 1's: the best


def test_the_recorded_state_is_put_back_in_a_new_attempt():
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9, restore_best_weights=True)
    model = _model()
    carried = CarriedState([stopper], None, lambda epoch: None)
    _fit(model, [carried.guard, stopper, carried], carried, [(0, 2)])
    record = json.loads(json.dumps(capture([stopper])))  # through the checkpoint's JSON
    assert record[0]["state"]["wait"] == 1 and record[0]["state"]["restore_best_weights"] is True
    best = [np.full_like(w, 7.0) for w in model.get_weights()]
    asked = []
    fresh = keras.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9, restore_best_weights=True)
    carried = CarriedState([fresh], record, lambda epoch: asked.append(epoch) or best)
    after = _fit(_model(), [carried.guard, fresh, carried], carried, [(2, 10)])
    assert asked == [1]  # the best epoch's checkpoint (epoch 1)
    assert fresh.stopped_epoch == 3  # wait 1 carried: two more epochs reach patience 3
    assert all(np.array_equal(a, b) for a, b in zip(after[-1], best))
