"""What the user's stateful callbacks hold between epochs, carried over where one process would keep it.

In one process, EarlyStopping's ``wait``, ``best`` and ``best_weights`` (ReduceLROnPlateau's ``wait``,
``best`` and cooldown; ModelCheckpoint's ``best``) live as long as the fit. Here a fit may be several
attempts (restarts, elastic resizes, a later fit of the run) and an attempt several ``model.fit`` calls
(the rest of an epoch resumed from a commit, then whole epochs), and each of those callbacks resets its
state in ``on_train_begin``. So rank 0 records the state with every checkpoint (:func:`capture`, the
JSON's ``callbacks``), and :class:`CarriedState` puts it back at every training start: from the
checkpoint the attempt resumed from, then from the ``model.fit`` call before. EarlyStopping's best
weights are not recorded: they are the model of the checkpoint of its ``best_epoch``.

Only these callbacks' state is carried (by ``isinstance``, subclasses included); a user's own callback
starts each attempt anew (docs/estimator.md, "Resume").
"""

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import keras

logger = logging.getLogger(__name__)

STATEFUL: tuple[tuple[type, tuple[str, ...]], ...] = (
    (keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "best", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint, ("best",)),
)


def _names(cb) -> tuple[str, ...]:
    for cls, names in STATEFUL:
        if isinstance(cb, cls):
            return names
    return ()


def _plain(value: Any) -> Any:
    """A JSON value (infinities and NaN as strings: the checkpoint's JSON stays standard)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return str(number) if math.isinf(number) or math.isnan(number) else number


def _value(plain: Any) -> Any:
    return float(plain) if plain in ("inf", "-inf", "nan") else plain


def capture(callbacks: Sequence) -> list[dict | None]:
    """Per callback (in the user's order), its state: ``{"class", "state"}``, or None (nothing carried)."""
    out: list[dict | None] = []
    for cb in callbacks:
        names = _names(cb)
        state = {n: _plain(getattr(cb, n, None)) for n in names}
        if restores_best(cb):  # the driver's fallback for the model the fit ends with (data/stops.py)
            state["restore_best_weights"] = True
        out.append({"class": type(cb).__qualname__, "state": state} if names else None)
    return out


def restores_best(cb) -> bool:
    return isinstance(cb, keras.callbacks.EarlyStopping) and bool(cb.restore_best_weights)


class CarriedState(keras.callbacks.Callback):
    """Put right after the user's callbacks. ``records``: the state recorded with the checkpoint the
    attempt resumed from (None: the run's start). ``best_weights_of(epoch)``: the weights of the
    checkpoint after ``epoch`` epochs (None when it is gone). ``final``: set by ``train`` before each
    ``model.fit``; at the end of one that is not the attempt's last (and not stopped by the callbacks),
    EarlyStopping's restore of its best weights (Keras does it at every training end) is undone, as one
    process restores them only at the end."""

    def __init__(
        self,
        callbacks: Sequence,
        records: Sequence[dict | None] | None,
        best_weights_of: Callable[[int], list | None],
    ):
        super().__init__()
        self.callbacks, self.records, self.best_weights_of = list(callbacks), records, best_weights_of
        self.final = True
        self.guard = _WeightsGuard(self)  # put before the user's callbacks
        self._kept: list[tuple[Any, dict, Any]] | None = None

    def on_train_begin(self, logs=None):
        if self._kept is not None:  # the model.fit before, in this attempt
            for cb, state, best_weights in self._kept:
                for name, value in state.items():
                    setattr(cb, name, value)
                if best_weights is not None:
                    cb.best_weights = best_weights
            return
        if not self.records:
            return
        if len(self.records) != len(self.callbacks):
            logger.warning(
                "the run's checkpoint records the state of %d callback(s), this fit has %d: their state starts anew",
                len(self.records),
                len(self.callbacks),
            )
            return
        for cb, record in zip(self.callbacks, self.records):
            if record is None or record.get("class") != type(cb).__qualname__ or not _names(cb):
                continue
            for name, value in (record.get("state") or {}).items():
                if name in _names(cb):
                    setattr(cb, name, _value(value))
            if restores_best(cb) and record["state"].get("best") is not None:
                cb.best_weights = self.best_weights_of(int(cb.best_epoch) + 1)

    def on_train_end(self, logs=None):
        self._kept = [
            (cb, {n: getattr(cb, n, None) for n in _names(cb)}, getattr(cb, "best_weights", None))
            for cb in self.callbacks
            if _names(cb)
        ]
        if self.guard.weights is not None and not self.model.stop_training:
            self.model.set_weights(self.guard.weights)  # the training goes on from where it was
        self.guard.weights = None


class _WeightsGuard(keras.callbacks.Callback):
    """Before the user's callbacks: at the end of a ``model.fit`` that is not the attempt's last, the
    weights before EarlyStopping restores its best (put back by :class:`CarriedState`)."""

    def __init__(self, carried: CarriedState):
        super().__init__()
        self.carried = carried
        self.weights: list | None = None

    def on_train_end(self, logs=None):
        going_on = not self.carried.final and not self.model.stop_training  # a stop ends the attempt here
        if going_on and any(restores_best(cb) for cb in self.carried.callbacks):
            self.weights = self.model.get_weights()
