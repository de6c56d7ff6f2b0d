"""``TorchEstimator``'s callbacks: hooks of the user's own, called on every rank by ``rank/torch_train.py``.

A callback is an object with any of these methods (``hvd_spark.torch.Callback`` has them all, doing
nothing): ``on_train_begin(state)``, ``on_epoch_begin(epoch, state)``, ``on_batch_end(step, logs, state)``
(``logs["loss"]``: this rank's loss of the step, normalised over the global batch, so that the ranks' mean
is the global batch's loss), ``on_epoch_end(epoch, logs, state)`` (``logs``: the epoch's history entry,
``val_`` keys included, before its checkpoint is written) and ``on_train_end(state)`` (also when the
attempt stops to grow); epochs and steps count from 0 as in Keras. ``state`` (:class:`TrainState`) holds
the module, the optimizer, the rank and the world size. A callback sets ``state.stop_training = True``
(in ``on_epoch_end`` or an earlier hook of the epoch) to end the fit after that epoch, on any rank: the
ranks agree, and the stop is recorded in the epoch's checkpoint, so that a restart or a later fit of the
run does not train on.
"""

from dataclasses import dataclass
from typing import Any

HOOKS = ("on_train_begin", "on_epoch_begin", "on_batch_end", "on_epoch_end", "on_train_end")


class Callback:
    """A ``TorchEstimator`` callback doing nothing: subclass it and override the hooks you need."""

    def on_train_begin(self, state: "TrainState") -> None:
        """Before the first step of this attempt (after a restart or a resize too)."""

    def on_epoch_begin(self, epoch: int, state: "TrainState") -> None:
        """Before the first step of ``epoch`` (0-based), or of its rest when it resumes."""

    def on_batch_end(self, step: int, logs: dict, state: "TrainState") -> None:
        """After step ``step`` of the epoch (0-based); ``logs["loss"]``: this rank's loss (the ranks' mean is
        the global batch's)."""

    def on_epoch_end(self, epoch: int, logs: dict, state: "TrainState") -> None:
        """After ``epoch``: ``logs`` is its history entry; set ``state.stop_training`` to end the fit."""

    def on_train_end(self, state: "TrainState") -> None:
        """After the last epoch of this attempt (not after a rank failed)."""


@dataclass
class TrainState:
    """What a callback sees: the module (not its DDP wrapper), the optimizer, this rank, the world size."""

    model: Any
    optimizer: Any
    rank: int
    size: int
    stop_training: bool = False


def is_callback(x) -> bool:
    """An object with one of the hooks at least, and not a Keras callback (whose hooks take other
    arguments)."""
    if any(c.__module__.split(".")[0] in ("keras", "tf_keras", "tensorflow") for c in type(x).__mro__):
        return False
    return any(callable(getattr(x, h, None)) for h in HOOKS)


class Callbacks:
    """The user's callbacks of one attempt on one rank."""

    def __init__(self, callbacks: list, state: TrainState):
        self.callbacks, self.state = list(callbacks or []), state
        self.stopped_by: list[str] = []  # the callbacks that set stop_training on this rank, in order

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args) -> None:
        """``hook(*args, state)`` of each callback that has it; who sets ``stop_training`` is noted."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if callable(fn):
                before = self.state.stop_training
                fn(*args, self.state)
                if self.state.stop_training and not before:
                    self.stopped_by.append(type(cb).__name__)
