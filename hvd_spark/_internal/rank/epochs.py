"""A rank's epochs in the data plan (``common/dataplan.py``): the segments of epochs an attempt runs
(a resumed epoch's rest, then whole epochs) and the cursor each commit records. No Keras or torch:
the Keras ranks (``cursor.py``'s callbacks, ``train.py``) and the torch ranks (``torch_train.py``) share it.
"""

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hvd_spark._internal.common import settings
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
        self.units = [Unit(*u) for u in cfg.reading.train_units]
        self.rows = sum(u.rows for u in self.units)
        self.layout = layout_digest(
            self.units,
            cfg.reading.train_paths,
            seed=cfg.seed,
            shuffle=cfg.reading.shuffle,
            window_rows=cfg.reading.shuffle_buffer_size,
        )
        self.restarted_epoch: int | None = None  # set by segments(): a commit's epoch that starts again

    def epoch(self, e: int) -> EpochPlan:
        cfg = self.cfg
        return epoch_plan(
            self.units, e, seed=cfg.seed, shuffle=cfg.reading.shuffle, window_rows=cfg.reading.shuffle_buffer_size
        )

    def segments(self) -> list[Segment]:
        """What this attempt runs: the resumed epoch's rest (when the commit lies inside it), then the
        remaining epochs whole."""
        cfg = self.cfg
        first = cfg.start.initial_epoch
        out: list[Segment] = []
        cursor = Cursor.from_json(cfg.start.resume_cursor) if cfg.start.resume_step else None
        if cursor is not None:
            split = shares(self.rows, cursor.used, self.size, first)
            if cursor.layout != self.layout or cursor.epoch != first:
                why = "was made on other data or another reading order"
            elif cfg.reading.fixed_steps and cfg.reading.fixed_steps > cursor.steps:
                # a fixed number of steps goes over the shares again: what is left, or all rows anew
                used = cursor.used if split.rows else ()
                out.append(Segment(first, first + 1, cfg.reading.fixed_steps - cursor.steps, used, cursor.steps))
                first, why = first + 1, ""
            elif not cfg.reading.fixed_steps and split.rows:
                steps = steps_for(split.rows, cfg.reading.batch_size)
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
                    cfg.start.resume_step,
                    why,
                    first + 1,
                )
        if first < cfg.epochs:
            out.append(Segment(first, cfg.epochs, cfg.shares.steps_per_epoch))
        return out

    def epochs_of(self, seg: Segment, rank: int) -> Callable[[], Iterator[tuple[EpochPlan, tuple, int]]]:
        """For the reader: ``(plan, this rank's share, rows to read)`` of each epoch of ``seg``."""

        def epochs():
            for e in range(seg.first, seg.end):
                yield self.epoch_share(seg, rank, e)

        return epochs

    def epoch_share(self, seg: Segment, rank: int, e: int) -> tuple[EpochPlan, tuple, int]:
        """``(plan, this rank's share, rows to read)`` of epoch ``e`` of ``seg``."""
        split = shares(self.rows, seg.used if e == seg.first else (), self.size, e)
        rows = seg.steps * self.cfg.reading.batch_size if self.cfg.reading.fixed_steps else split.rows
        return self.epoch(e), split.per_rank[rank], rows

    def cursor(self, seg: Segment, epoch: int, steps: int) -> Cursor:
        """The cursor after ``steps`` steps of ``epoch`` within ``seg``, on every rank."""
        before = seg.used if epoch == seg.first else ()
        split = shares(self.rows, before, self.size, epoch)
        used = used_after(before, split, min(steps * self.cfg.reading.batch_size, split.rows))
        return Cursor(epoch, tuple(used), self.layout, (seg.steps_before if epoch == seg.first else 0) + steps)


def kept_validation_bytes(cfg: RunConfig) -> int:
    """How many bytes of its validation rows a rank keeps in memory after reading them once
    (``KEEP_VALIDATION_BYTES``); none with a ``transformation_fn``, which may draw at random: its rows
    are made anew at each validation, as one process would."""
    return 0 if cfg.reading.transformation_fn else settings.KEEP_VALIDATION_BYTES.get()


def data_trace(rank: int, seg: Segment, size: int):
    """``HVD_SPARK_DATA_TRACE``: a JSON line per batch read (epoch, step within the epoch, the first
    feature column's values), appended to this process's file in that folder; None when unset."""
    folder = settings.DATA_TRACE.get()
    if not folder:
        return None
    import json

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.jsonl")

    def trace(epoch: int, step: int, batch: dict) -> None:
        first = next(iter(batch.values()))
        ids = first[:, 0] if first.ndim > 1 else first
        step += seg.steps_before if epoch == seg.first else 0
        record = {"t": time.time(), "rank": rank, "size": size, "epoch": epoch, "step": step, "ids": ids.tolist()}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    return trace
