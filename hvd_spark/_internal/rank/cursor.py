"""A rank's place in the data plan (``common/dataplan.py``) during ``fit``: the segments of epochs
that ``model.fit`` runs, the cursor each commit records, and the callbacks of elastic training.

A resumed run whose commit lies inside an epoch first runs that epoch alone, with the steps its
remaining rows take on this many ranks, then the other epochs with the full-epoch steps: Keras takes
one ``steps_per_epoch`` per ``fit`` call, so these are two calls (callbacks see ``on_train_begin``
twice).
"""

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import keras

from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.dataplan import (
    Cursor,
    EpochPlan,
    Interval,
    Unit,
    epoch_plan,
    layout_digest,
    shares,
    steps_for,
    used_after,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """Epochs ``first .. end-1`` (0-based) of ``steps`` steps each; epoch ``first`` continues after
    ``steps_before`` steps that used the positions ``used``."""

    first: int
    end: int
    steps: int
    used: tuple[Interval, ...] = ()
    steps_before: int = 0


class DataPlan:
    """The training data of a fit as every rank sees it: its row groups, the epochs' orders and each
    rank's share on ``size`` ranks."""

    def __init__(self, cfg: RunConfig, size: int):
        self.cfg, self.size = cfg, size
        self.units = [Unit(*u) for u in cfg.train_units]
        self.rows = sum(u.rows for u in self.units)
        self.layout = layout_digest(
            self.units, cfg.train_paths, seed=cfg.seed, shuffle=cfg.shuffle, window_rows=cfg.shuffle_buffer_size
        )
        self.restarted_epoch: int | None = None  # set by segments(): a commit's epoch that starts again

    def epoch(self, e: int) -> EpochPlan:
        cfg = self.cfg
        return epoch_plan(self.units, e, seed=cfg.seed, shuffle=cfg.shuffle, window_rows=cfg.shuffle_buffer_size)

    def segments(self) -> list[Segment]:
        """What this attempt runs: the resumed epoch's rest (when the commit lies inside it), then the
        remaining epochs whole."""
        cfg = self.cfg
        first = cfg.initial_epoch
        out: list[Segment] = []
        cursor = Cursor.from_json(cfg.resume_cursor) if cfg.resume_step else None
        if cursor is not None:
            split = shares(self.rows, cursor.used, self.size, first)
            if cursor.layout != self.layout or cursor.epoch != first:
                why = "was made on other data or another reading order"
            elif cfg.fixed_steps and cfg.fixed_steps > cursor.steps:
                # a fixed number of steps goes over the shares again: what is left, or all rows anew
                used = cursor.used if split.rows else ()
                out.append(Segment(first, first + 1, cfg.fixed_steps - cursor.steps, used, cursor.steps))
                first, why = first + 1, ""
            elif not cfg.fixed_steps and split.rows:
                steps = steps_for(split.rows, cfg.batch_size)
                out.append(Segment(first, first + 1, steps, cursor.used, cursor.steps))
                first, why = first + 1, ""
            else:
                why = "left no rows to read"
            if why:
                # The epoch starts again: its commits go (the new ones would take their names).
                self.restarted_epoch = first
                logger.warning(
                    "the commit at epoch %d step %d %s; epoch %d starts again from its first row",
                    first,
                    cfg.resume_step,
                    why,
                    first + 1,
                )
        if first < cfg.epochs:
            out.append(Segment(first, cfg.epochs, cfg.steps_per_epoch))
        return out

    def epochs_of(self, seg: Segment, rank: int) -> Callable[[], Iterator[tuple[EpochPlan, tuple, int]]]:
        """For the reader: ``(plan, this rank's share, rows to read)`` of each epoch of ``seg``."""

        def epochs():
            for e in range(seg.first, seg.end):
                split = shares(self.rows, seg.used if e == seg.first else (), self.size, e)
                rows = seg.steps * self.cfg.batch_size if self.cfg.fixed_steps else split.rows
                yield self.epoch(e), split.per_rank[rank], rows

        return epochs

    def cursor(self, seg: Segment, epoch: int, steps: int) -> Cursor:
        """The cursor after ``steps`` steps of ``epoch`` within ``seg``, on every rank."""
        before = seg.used if epoch == seg.first else ()
        split = shares(self.rows, before, self.size, epoch)
        used = used_after(before, split, min(steps * self.cfg.batch_size, split.rows))
        return Cursor(epoch, tuple(used), self.layout, (seg.steps_before if epoch == seg.first else 0) + steps)


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
