"""The restart policy and the fit summary records: pure functions and dataclasses."""

import dataclasses

import pytest

from hvd_spark._internal.common.contracts import FitSummary, RankSummary
from hvd_spark._internal.common.restarts import should_restart
from hvd_spark.errors import HvdSparkError, JobTimeoutError, LaunchError, RankFailedError, RankStalledError


def _rank_failed():
    return RankFailedError(1, "ProcessDied", "killed by signal 9")


@pytest.mark.parametrize(
    "error",
    [_rank_failed(), LaunchError("tasks did not start"), JobTimeoutError("late"), RankStalledError("stalled", [1])],
)
def test_job_failures_restart_until_the_limit(error):
    assert should_restart(error, 0, 2) and should_restart(error, 1, 2)
    assert not should_restart(error, 2, 2)
    assert not should_restart(error, 0, 0)  # max_restarts=0: never


@pytest.mark.parametrize("error", [ValueError("bad input"), HvdSparkError("weights differ"), KeyboardInterrupt()])
def test_other_errors_never_restart(error):
    assert not should_restart(error, 0, 5)


def test_rank_summary_from_a_rank_result_and_frozen_records():
    r = RankSummary.from_result({"rank": 1, "weights_digest": "ab", "iterations": 40, "extra": "ignored"})
    assert (r.rank, r.weights_digest, r.iterations, r.train_seconds) == (1, "ab", 40, None)
    s = FitSummary("run", "key", 20, 0, 1.0, 9.0, 12.0, (r,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.restarts = 3  # type: ignore[misc]


def test_run_config_pickles_and_changes_per_attempt():
    import pickle

    from hvd_spark._internal.common.contracts import AttemptStart, DataSpec, Reading, RunConfig, Shares, Training
    from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec

    data = DataSpec(
        (ColumnInfo("x", "array", "float", False, stored="c0"),),
        (ColumnInfo("y", "scalar", "int", True, stored="c1"),),
        None,
        (TensorSpec("x", (4,), "float32"),),
        (TensorSpec("y", (1,), "float32"),),
    )
    base = RunConfig(
        store={"prefix": "/s", "storage_options": {}},
        run_id="r",
        epochs=3,
        data=data,
        seed=1,
        verbose=1,
        progress_interval=0.0,
        num_threads=1,
        reading=Reading(batch_size=8, val_batch_size=8, shuffle=True, shuffle_buffer_size=100, reader="arrow"),
        training=Training(compile={}),
        shares=Shares(train_files=[["a"], ["b"]], val_files=None, steps_per_epoch=5, validation_steps=None),
        start=AttemptStart(model_bytes=b"model"),
    )
    second = dataclasses.replace(base, start=dataclasses.replace(base.start, initial_epoch=2, resume_ckpt="/s/ckpt"))
    assert pickle.loads(pickle.dumps(second)) == second and base.start.initial_epoch == 0
    assert (
        second.start.model_bytes == b"model" and second.reading is base.reading
    )  # the other groups travel as they were
    # a new attempt's start replaces the whole group: nothing of the earlier attempt's start is left
    third = dataclasses.replace(second, start=AttemptStart(initial_epoch=3, resume_ckpt="/s/ckpt3"))
    assert third.start.model_bytes is None and third.start.initial_epoch == 3 and third.shares == base.shares
    kw = data.reader_kwargs()
    assert kw["features"][0].stored == "c0" and kw["weight"] is None and kw["inputs"][0].dims == (4,)


def test_pick_failure_prefers_the_cause_over_lost_peers():
    from hvd_spark._internal.common.outcomes import RankOutcome, pick_failure

    lost_peer = RankOutcome(
        0,
        "error",
        type="tensorflow.python.framework.errors_impl.UnknownError",
        time=1.0,
        message="Graph execution error: ... HorovodAllreduce_grads_0 ... Connection closed by peer",
    )
    died = RankOutcome(1, "error", type="ProcessDied", message="process killed by signal 9 (SIGKILL)", time=2.0)
    raised = RankOutcome(1, "error", type="ValueError", message="bad shard", time=3.0)
    assert pick_failure([lost_peer, died]).rank == 1
    assert pick_failure([lost_peer, raised]).type == "ValueError"
    later, earlier = dataclasses.replace(raised, rank=1, time=5.0), dataclasses.replace(raised, rank=0, time=4.0)
    assert pick_failure([later, earlier]).rank == 0
    assert lost_peer.is_secondary and not died.is_secondary and not raised.is_secondary


def test_outcome_travels_as_a_fail_message_and_back():
    from hvd_spark._internal.common.outcomes import RankOutcome

    rec = RankOutcome(2, "error", type="ValueError", message="x" * 5000, traceback="tb", time=7.0, pickled=b"p")
    msg = rec.to_message()
    assert len(msg["message"]) == 2000 and "pickled" not in msg and "traceback" not in msg
    back = RankOutcome.from_message(msg)
    assert (back.rank, back.status, back.type, back.time) == (2, "error", "ValueError", 7.0)
    aborted = rec.as_aborted()
    assert aborted.status == "aborted" and aborted.type == "" and aborted.pickled is None


def _aborted(rank, *tail):
    from hvd_spark._internal.common.outcomes import ABORTED, RankOutcome

    return RankOutcome(rank, ABORTED, tail=tuple(tail))


def test_a_stall_report_names_the_silent_rank_first_with_where_each_rank_was():
    import pickle

    from hvd_spark._internal.common.outcomes import STATE_PREFIX
    from hvd_spark._internal.driver.supervisor import JobReport, Problem, conclude

    problem = Problem("stalled: no rank made progress", [0, 1], stalled_hosts={0: "10.0.0.1", 1: "10.0.0.2"})
    records = [
        _aborted(0, f"{STATE_PREFIX}sleeping", "Stack (most recent call first):", '  File "x.py", line 3 in fit'),
        _aborted(1, f"{STATE_PREFIX}stopped"),  # a stopped process prints no stack
    ]
    with pytest.raises(RankStalledError) as caught:
        conclude(records, JobReport(problem=problem), num_proc=2, description="job", elapsed=1.0)
    err = pickle.loads(pickle.dumps(caught.value))
    assert err.ranks == [1, 0] and err.hosts == {0: "10.0.0.1", 1: "10.0.0.2"}
    assert "Most likely stalled: rank(s) [1]" in str(err)
    assert "rank 1 (process stopped): no stack: the process did not answer SIGUSR1" in str(err)
    assert 'rank 0 (process sleeping): File "x.py", line 3 in fit' in str(err)


def test_a_stall_with_every_rank_in_user_code_names_no_suspect():
    from hvd_spark._internal.driver.supervisor import JobReport, Problem, conclude

    problem = Problem("stalled", [0, 1], stalled_hosts={0: "h", 1: "h"})
    records = [_aborted(r, "Stack (most recent call first):", '  File "x.py", line 3 in fit') for r in (0, 1)]
    with pytest.raises(RankStalledError) as caught:
        conclude(records, JobReport(problem=problem), num_proc=2, description="job", elapsed=1.0)
    assert "Most likely" not in str(caught.value) and caught.value.ranks == [0, 1]
