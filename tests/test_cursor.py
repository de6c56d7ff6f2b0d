"""A rank's place in the data plan (rank/cursor.py) without Spark: the segments a resumed attempt runs
and the cursor a commit records, for commits made on any number of ranks and resumed on any other."""

import dataclasses

from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.dataplan import count, shares
from hvd_spark._internal.data.store import Store
from hvd_spark._internal.rank.cursor import DataPlan, Segment
from tests.fast.test_fit_planning import _config

UNITS = ((0, 0, 40), (0, 1, 35), (1, 0, 25))  # 100 rows


def _cfg(*, seed=5, steps_per_epoch=5, fixed_steps=None, **start) -> RunConfig:
    """The fast tier's run configuration, with the data plan's fields: 100 rows in 3 row groups, 3 ranks
    (``start``: the attempt's, ``AttemptStart``'s fields)."""
    base = _config(Store("/unused"), "r", 3)
    return dataclasses.replace(
        base,
        seed=seed,
        reading=dataclasses.replace(
            base.reading,
            batch_size=8,
            shuffle_buffer_size=30,
            train_paths=("a.parquet", "b.parquet"),
            train_units=UNITS,
            fixed_steps=fixed_steps,
        ),
        # on 3 ranks: floor(100 / 3) = 33 rows a rank, in steps of 8
        shares=dataclasses.replace(base.shares, steps_per_epoch=steps_per_epoch),
        start=dataclasses.replace(base.start, **start),
    )


def test_a_commit_made_on_three_ranks_resumes_on_two_with_the_rows_left():
    on3 = DataPlan(_cfg(), 3)  # 33 rows per rank: 5 steps of 8 (the last one 1 row)
    seg = on3.segments()[0]
    cursor = on3.cursor(seg, 0, 2)  # two steps: 16 rows read by each of the 3 ranks
    assert count(cursor.used) == 48 and cursor.steps == 2
    on2 = DataPlan(_cfg(initial_epoch=0, resume_step=2, resume_cursor=cursor.to_json(), steps_per_epoch=7), 2)
    first, rest = on2.segments()
    left = shares(100, cursor.used, 2, 0)
    assert first == Segment(0, 1, 4, cursor.used, 2)  # 26 rows each on two ranks: 4 steps
    assert left.rows == 26 and rest == Segment(1, 3, 7)
    # the two ranks read exactly the positions left, once
    read = [p for r in range(2) for a, b in list(on2.epochs_of(first, r)())[0][1] for p in range(a, b)]
    assert len(read) == len(set(read)) == 52 and not set(read) & {p for a, b in cursor.used for p in range(a, b)}
    # a commit of the resumed epoch counts its steps after the earlier ones
    assert on2.cursor(first, 0, 1).steps == 3


def test_a_cursor_of_other_data_starts_the_epoch_again_and_says_which():
    on3 = DataPlan(_cfg(), 3)
    cursor = on3.cursor(on3.segments()[0], 0, 2)
    other = DataPlan(_cfg(seed=6, resume_step=2, resume_cursor=cursor.to_json()), 3)  # another order
    assert other.segments() == [Segment(0, 3, 5)] and other.restarted_epoch == 0
    later = DataPlan(_cfg(initial_epoch=1, resume_step=2, resume_cursor=cursor.to_json()), 3)  # another epoch
    assert later.segments() == [Segment(1, 3, 5)] and later.restarted_epoch == 1


def test_a_fixed_number_of_steps_resumes_with_the_steps_left_even_when_every_row_was_read():
    plan = DataPlan(_cfg(fixed_steps=10, steps_per_epoch=10), 2)  # 10 x 8 = 80 rows a rank: over its 50
    seg = plan.segments()[0]
    cursor = plan.cursor(seg, 0, 8)  # 64 rows each: the whole share, read once and part again
    assert count(cursor.used) == 100
    resumed = DataPlan(_cfg(fixed_steps=10, steps_per_epoch=10, resume_step=8, resume_cursor=cursor.to_json()), 2)
    first, rest = resumed.segments()
    assert first == Segment(0, 1, 2, (), 8) and rest == Segment(1, 3, 10)  # the 2 steps left, on fresh shares
    assert resumed.restarted_epoch is None
