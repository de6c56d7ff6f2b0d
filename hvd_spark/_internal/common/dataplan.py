"""Which training rows each rank reads in an epoch: a pure function of the data's row groups, the
epoch, the seed and the world size, so that every rank (and the driver) computes the same plan, and
a run that stops mid-epoch continues with exactly the rows not yet used, on any number of ranks.

The rows of an epoch form one sequence of *positions* ``0 .. N-1``:

* the row groups (:class:`Unit`) are put in an order: a permutation seeded by ``(seed, epoch)``
  with ``shuffle``, else the stored order rotated by the epoch;
* consecutive row groups of that order form *windows* of at least ``window_rows`` rows (the
  estimator's ``shuffle_buffer_size``); with ``shuffle`` the rows of a window are permuted
  (seeded by ``(seed, epoch, window)``), so rows of different row groups share batches;
* position ``p`` is the ``p``-th row of the concatenated windows.

What an epoch has used is a set of position intervals (the *cursor*). The positions not yet used
are cut into ``size`` contiguous shares of ``floor(remaining / size)`` positions, one per rank; the
``remaining % size`` positions at the end (fewer than ``size``) are left out, so that every rank
runs the same number of steps (with fewer positions left than ranks, each rank gets one of them and
some get the same: every rank needs a batch). They are the last positions of the epoch's order, which changes
every epoch, so the rows left out rotate. No position is used twice in an epoch: a share never
holds a used position, and a resumed or resized epoch only divides what is left.

Nothing here reads data: :mod:`hvd_spark._internal.rank.reader` turns a share into rows.
"""

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Interval = tuple[int, int]  # positions [start, end)


@dataclass(frozen=True)
class Unit:
    """A row group with rows: ``group`` of file number ``file``."""

    file: int
    group: int
    rows: int


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's reading order: ``order`` (indices into the units), cut into windows; window ``w``
    holds ``order[cuts[w]:cuts[w + 1]]`` and positions ``starts[w] .. starts[w + 1] - 1``."""

    epoch: int
    order: tuple[int, ...]
    cuts: tuple[int, ...]
    starts: tuple[int, ...]
    shuffle: bool
    seed: int

    @property
    def rows(self) -> int:
        return self.starts[-1]

    @property
    def windows(self) -> int:
        return len(self.cuts) - 1

    def window_units(self, w: int) -> tuple[int, ...]:
        return self.order[self.cuts[w] : self.cuts[w + 1]]

    def window_permutation(self, w: int) -> np.ndarray | None:
        """Row ``j`` of window ``w`` (in position order) is row ``perm[j]`` of the window's units
        read in order and concatenated; None: the identity (no shuffle)."""
        if not self.shuffle:
            return None
        n = self.starts[w + 1] - self.starts[w]
        return np.random.default_rng([self.seed & 0xFFFFFFFF, self.epoch, w, 0x5EED]).permutation(n)


def epoch_plan(units: Sequence[Unit], epoch: int, *, seed: int, shuffle: bool, window_rows: int) -> EpochPlan:
    """The reading order of ``epoch`` (see the module's docstring)."""
    if not units:
        raise ValueError("the training data has no row groups with rows")
    n = len(units)
    if shuffle:
        order = [int(i) for i in np.random.default_rng([seed & 0xFFFFFFFF, epoch, 0x0DE5]).permutation(n)]
    else:
        k = epoch % n
        order = list(range(k, n)) + list(range(k))
    cuts, starts = [0], [0]
    held = 0
    for i, u in enumerate(order):
        held += units[u].rows
        if held >= max(1, window_rows if shuffle else 1) or i == n - 1:
            cuts.append(i + 1)
            starts.append(starts[-1] + held)
            held = 0
    return EpochPlan(epoch, tuple(order), tuple(cuts), tuple(starts), bool(shuffle), int(seed))


def merge(intervals: Sequence[Sequence[int]]) -> list[Interval]:
    """Sorted, disjoint, non-empty intervals covering the same positions."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def remaining(total: int, used: Sequence[Sequence[int]]) -> list[Interval]:
    """The positions of ``0 .. total-1`` outside ``used``."""
    out, at = [], 0
    for a, b in merge(used):
        if a > at:
            out.append((at, min(a, total)))
        at = max(at, b)
    if at < total:
        out.append((at, total))
    return [(a, b) for a, b in out if b > a]


def count(intervals: Sequence[Sequence[int]]) -> int:
    return sum(int(b) - int(a) for a, b in intervals)


def take(intervals: Sequence[Interval], n: int) -> tuple[list[Interval], list[Interval]]:
    """The first ``n`` positions of ``intervals`` (in order) and the rest."""
    head, tail = [], []
    for a, b in intervals:
        if n <= 0:
            tail.append((a, b))
        elif b - a <= n:
            head.append((a, b))
            n -= b - a
        else:
            head.append((a, a + n))
            tail.append((a + n, b))
            n = 0
    return head, tail


@dataclass(frozen=True)
class Shares:
    """The positions each of ``size`` ranks reads in what is left of an epoch."""

    per_rank: tuple[tuple[Interval, ...], ...]
    rows: int  # positions per rank (the same for every rank)
    left_out: int  # positions of the remainder nobody reads in this epoch (< size)


def shares(total: int, used: Sequence[Sequence[int]], size: int, epoch: int = 0) -> Shares:
    """Cuts the unused positions of an epoch of ``total`` rows into ``size`` equal contiguous shares.

    The ``left % size`` positions nobody reads are the last ones of the unused sequence started at
    ``epoch * (left % size)`` (wrapping around): another block every epoch, so that the rows left out
    rotate even where the order does not change (no shuffle, one row group)."""
    if size < 1:
        raise ValueError(f"size must be at least 1. Received: {size}.")
    rest = remaining(total, used)
    left = count(rest)
    if left and left % size and epoch:
        head, tail = take(rest, (epoch * (left % size)) % left)
        rest = tail + head
    if 0 < left < size:  # fewer rows than ranks: one each, some the same (the one case of a row read twice)
        positions = [p for a, b in rest for p in range(a, b)]
        return Shares(tuple(((positions[r % left], positions[r % left] + 1),) for r in range(size)), 1, 0)
    q = left // size
    per_rank = []
    for _ in range(size):
        mine, rest = take(rest, q)
        per_rank.append(tuple(mine))
    return Shares(tuple(per_rank), q, count(rest))


def used_after(before: Sequence[Sequence[int]], split: Shares, rows_each: int) -> list[Interval]:
    """The used positions once every rank has read the first ``rows_each`` positions of its share."""
    out = [tuple(i) for i in before]
    for mine in split.per_rank:
        out += take(list(mine), min(rows_each, split.rows))[0]
    return merge(out)


def steps_for(rows_per_rank: int, batch_size: int) -> int:
    """Steps in which a rank reads its share: batches of ``batch_size``, the last one smaller."""
    return -(-rows_per_rank // batch_size) if rows_per_rank > 0 else 0


def layout_digest(units: Sequence[Unit], files: Sequence[str], *, seed: int, shuffle: bool, window_rows: int) -> str:
    """What a cursor's positions mean: the same digest, the same rows at the same positions."""
    record = json.dumps(
        [[u.file, u.group, u.rows] for u in units] + [list(files), int(seed), bool(shuffle), int(window_rows)]
    )
    return hashlib.sha256(record.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Cursor:
    """How far an epoch got: ``used`` positions of epoch ``epoch`` (0-based), in ``steps`` steps of
    its current attempt(s), for the layout ``layout`` (:func:`layout_digest`)."""

    epoch: int
    used: tuple[Interval, ...]
    layout: str
    steps: int = 0

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "used": [list(i) for i in self.used], "layout": self.layout, "steps": self.steps}

    @classmethod
    def from_json(cls, d: dict | None) -> "Cursor | None":
        if not d:
            return None
        return cls(int(d["epoch"]), tuple((int(a), int(b)) for a, b in d["used"]), str(d["layout"]), int(d["steps"]))


def row_groups(files: Sequence[str], read_metadata) -> list[Unit]:
    """The row groups with rows of ``files``: ``read_metadata(path)`` gives a pyarrow FileMetaData."""
    units = []
    for i, path in enumerate(files):
        meta = read_metadata(path)
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if rows > 0:
                units.append(Unit(i, g, rows))
    return units
