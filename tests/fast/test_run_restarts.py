"""``hvd_spark.run``'s restarts go through the fit's controller and policies (ml/controller.py's
``RunJob``): a lost executor is dropped from the next elastic attempt, ``num_proc`` is checked against
``min_num_proc`` / ``max_num_proc`` before any work, the whole-job ``timeout`` is never restarted, and
failures are told apart by type, not by a name's ending. Ranks are played in process (the Spark
backend is replaced by ``InProcessBackend``)."""

import dataclasses

import pytest

import hvd_spark._run as run_mod
from hvd_spark._internal.common.outcomes import TASK_LOST
from hvd_spark._internal.common.restarts import should_restart
from hvd_spark._internal.driver.supervisor import Problem
from hvd_spark._internal.ml import backend as backend_mod
from hvd_spark._internal.ml import policies
from hvd_spark._internal.ml.backend import InProcessBackend, in_process_rank
from hvd_spark._internal.ml.policies import FailureDecision, FailurePolicy
from hvd_spark.errors import DataChangedError, JobDeadlineError, JobTimeoutError, RankFailedError, RunInUseError


@pytest.fixture
def backends(monkeypatch):
    """The Spark backend ``run`` makes, replaced by in-process ranks on 3 task slots; no settle waits."""
    made: list[InProcessBackend] = []

    def spark_backend(num_proc=None, env=None, on_event=None, **launch_kwargs):
        backend = InProcessBackend(num_proc or 3)
        backend.slots = 3
        made.append(backend)
        return backend

    wait = policies.wait_for_slots
    monkeypatch.setattr(backend_mod, "SparkBackend", spark_backend)
    monkeypatch.setattr(
        policies,
        "wait_for_slots",
        lambda b, elastic, why, sleep=None: wait(b, dataclasses.replace(elastic, settle=0.0), why, lambda s: None),
    )
    return made


def _restarts(fn, num_proc=None, max_restarts=1, min_num_proc=None, max_num_proc=None):
    return run_mod._run_with_restarts(fn, (), {}, num_proc, None, {}, max_restarts, min_num_proc, max_num_proc, None)


class LoseOnce:
    """The last rank's executor goes away in the first attempt (Spark still counts its slot)."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self):
        me = in_process_rank()
        if me.rank == 0:
            self.sizes.append(me.size)
        if len(self.sizes) == 1 and me.rank == me.size - 1:
            raise RankFailedError(me.rank, TASK_LOST, "the executor was lost", host="10.0.0.9")
        return me.size


def test_an_elastic_run_drops_a_lost_executor_that_spark_still_counts(backends):
    fn = LoseOnce()
    assert _restarts(fn, min_num_proc=1) == [2, 2]
    assert fn.sizes == [3, 2]  # before: [3, 3], the next attempt sized by a slot whose executor was gone


@pytest.mark.parametrize("num_proc, low, high", [(3, 1, 2), (1, 2, 3), (0, 1, 2)])
def test_num_proc_outside_min_and_max_is_refused_before_any_work(backends, num_proc, low, high):
    with pytest.raises(ValueError, match="num_proc"):
        _restarts(LoseOnce(), num_proc=num_proc, min_num_proc=low, max_num_proc=high)
    assert backends == []  # no backend made, nothing launched


def test_the_whole_job_timeout_is_never_restarted(backends):
    calls = []

    def fn():
        calls.append(in_process_rank().rank)
        raise JobDeadlineError("the job did not finish within timeout=5s; ranks [1] had not finished.", ranks=[1])

    with pytest.raises(JobDeadlineError):
        _restarts(fn, num_proc=2, max_restarts=3)
    assert calls == [0]  # one attempt: run(timeout=T, max_restarts=3) takes T, not 4 T
    assert isinstance(Problem("late", [1], deadline=True).error(), JobDeadlineError)
    assert type(Problem("not started", [1]).error()) is JobTimeoutError  # tasks that did not start: restarted
    assert should_restart(JobTimeoutError("not started"), 0, 1)


def test_failures_are_told_apart_by_type_not_by_a_names_ending():
    ours = RankFailedError(0, "hvd_spark.errors.DataChangedError", "a file changed")
    theirs = RankFailedError(0, "mypackage.errors.DataChangedError", "the user's own error of that name")
    assert ours.raised(DataChangedError) and not theirs.raised(DataChangedError)
    assert not should_restart(ours, 0, 1) and should_restart(theirs, 0, 1)
    mine = RankFailedError(0, "mypackage.RunInUseError", "a user's error")
    assert FailurePolicy(1).decide(mine, 0) is FailureDecision.RESTART  # before: taken over
    with_cause = RankFailedError(0, "x", "y")
    with_cause.__cause__ = RunInUseError("taken", run_id="r")
    assert FailurePolicy(1).decide(with_cause, 0) is FailureDecision.TAKEN_OVER


def test_two_elastic_jobs_of_one_driver_size_themselves_by_what_the_other_leaves(monkeypatch):
    """Before, each counted every slot of the application: two elastic fits side by side both sized
    themselves to all of them, and the second waited for the first in the slot pool (or timed out)."""
    from hvd_spark._internal.common import sessions
    from hvd_spark._internal.driver.slots import SLOTS

    monkeypatch.setattr(sessions, "application_id", lambda spark: "app-two-fits")
    backend = backend_mod.SparkBackend(spark=object())
    monkeypatch.setattr(backend, "_registered_slots", lambda: 4)
    assert backend.available_slots() == 4
    with SLOTS.claim("app-two-fits", 3, 4, "the other fit"):
        assert backend.available_slots() == 1  # the other fit's 3 are not this one's to take
        assert backend.available_slots(holding=3) == 4  # a running attempt's own slots are its own
        assert policies.slots_of(backend, holding=1) == 2
    assert backend.available_slots() == 4
