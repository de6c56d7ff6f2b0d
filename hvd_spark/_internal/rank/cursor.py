"""A Keras rank's place in the data plan (``common/dataplan.py``) during ``fit``: the segments of epochs
that ``model.fit`` runs and the cursor each commit records (``epochs.py``, shared with the torch ranks),
and the callbacks of elastic training.

A resumed run whose commit lies inside an epoch first runs that epoch alone, with the steps its
remaining rows take on this many ranks, then the other epochs with the full-epoch steps: Keras takes
one ``steps_per_epoch`` per ``fit`` call, so these are two calls (callbacks see ``on_train_begin``
twice).
"""

import logging
import time
from collections.abc import Callable

import keras

from hvd_spark._internal.rank.epochs import DataPlan, Segment

__all__ = ["DataPlan", "PositionCallback", "ResizeCheck", "Segment"]

logger = logging.getLogger(__name__)


class ResizeCheck(keras.callbacks.Callback):
    """Every rank, at each epoch end but the last: rank 0 looks for the driver's resize marker and
    broadcasts what it found, so that all ranks stop after the same epoch (its checkpoint written by
    then: this callback comes last) when training is to grow."""

    def __init__(self, marker_exists: Callable[[], bool], epochs: int):
        super().__init__()
        self.marker_exists, self.epochs = marker_exists, epochs
        self.stopped = False

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 >= self.epochs or self.model.stop_training:  # the ranks agreed: training ends here anyway
            return
        import horovod.tensorflow as hvd
        import tensorflow as tf

        flag = 1 if hvd.rank() == 0 and self.marker_exists() else 0
        agreed = int(hvd.broadcast(tf.constant([flag], tf.int32), root_rank=0, name=f"hvd_spark.resize.{epoch}")[0])
        if agreed:
            self.stopped = True
            self.model.stop_training = True
            if hvd.rank() == 0:
                logger.info("stopping after epoch %d: training resumes on more ranks", epoch + 1)


class PositionCallback(keras.callbacks.Callback):
    """Rank 0: tells the driver the optimizer's step count after the first step and then at most
    every ``interval`` seconds (what a recovery's redone steps and time are measured by)."""

    def __init__(self, send, interval: float = 0.5):
        super().__init__()
        self._send, self.interval = send, interval
        self._last: float | None = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval:
            return
        self._last = now
        self._send(
            {"kind": "position", "iterations": int(self.model.optimizer.iterations.numpy()), "time": time.time()}
        )
