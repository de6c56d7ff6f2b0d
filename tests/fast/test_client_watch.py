"""The timing rules of a job's end, as the Spark Connect client applies them (the coordinator's
Supervisor applies the same functions): start timeout, abort ignored, timeout overrun, give up."""

from types import SimpleNamespace

import pytest

from hvd_spark._internal.driver.supervisor import (
    CANCEL_AFTER,
    GIVE_UP_AFTER,
    ClientWatch,
    cancel_due,
    give_up_due,
    overrun_due,
)
from hvd_spark.errors import JobTimeoutError


def _opts(**kw):
    return SimpleNamespace(**{"start_timeout": 30.0, "abort_grace": 5.0, "timeout": None, **kw})


def _watch(opts, live=True):
    calls = []
    w = ClientWatch(opts, 2, "sc://h:15002", calls.append, live=live)
    w.t0 = 0.0
    return w, calls


def test_rules_count_from_their_own_event():
    opts = _opts()
    assert not cancel_due(None, opts, 1e9)
    assert not cancel_due(100.0, opts, 100.0 + 5.0 + CANCEL_AFTER)
    assert cancel_due(100.0, opts, 100.0 + 5.0 + CANCEL_AFTER + 0.1)
    assert not give_up_due(None, 1e9)
    assert give_up_due(0.0, GIVE_UP_AFTER - CANCEL_AFTER + 0.1) and not give_up_due(0.0, GIVE_UP_AFTER - CANCEL_AFTER)
    assert not overrun_due(0.0, opts, 1e9)  # no timeout: never overrun
    assert overrun_due(0.0, _opts(timeout=60.0), 60.0 + 5.0 + 2 * CANCEL_AFTER + 0.1)


def test_tasks_that_never_start_are_a_start_timeout_then_the_job_is_left():
    w, calls = _watch(_opts())
    assert w.step(now=29.0) and calls == []
    assert w.step(now=30.5)
    assert len(calls) == 1 and "did not start in time" in calls[0]
    assert isinstance(w.problem, JobTimeoutError) and w.problem.ranks == [0, 1]
    assert "the 2 barrier tasks did not all start within start_timeout=30s" in str(w.problem)
    assert w.step(now=30.5 + GIVE_UP_AFTER - CANCEL_AFTER - 1)
    assert not w.step(now=30.5 + GIVE_UP_AFTER - CANCEL_AFTER + 1)  # still running: stop waiting
    assert len(calls) == 1  # interrupted once


def test_started_tasks_are_no_start_timeout_and_without_a_channel_there_is_none():
    w, calls = _watch(_opts())
    w.see([{"k": "start"}], now=1.0)
    assert w.step(now=1000.0) and calls == [] and w.problem is None
    blind, calls = _watch(_opts(), live=False)
    assert blind.step(now=1000.0) and calls == [] and blind.problem is None


@pytest.mark.parametrize("grace", [0.0, 5.0])
def test_an_abort_the_tasks_ignore_is_cancelled_after_its_grace(grace):
    w, calls = _watch(_opts(abort_grace=grace))
    w.see([{"k": "start"}, {"k": "abort"}], now=10.0)
    assert w.step(now=10.0 + grace + CANCEL_AFTER) and calls == []
    w.step(now=10.0 + grace + CANCEL_AFTER + 0.5)
    assert calls == ["its tasks did not stop after an abort"]
    assert w.problem is None  # the coordinator's report says why it aborted


def test_a_job_that_outlives_its_timeout_is_interrupted_from_the_client():
    w, calls = _watch(_opts(timeout=60.0))
    w.see([{"k": "start"}], now=1.0)
    assert w.step(now=60.0 + 5.0 + 2 * CANCEL_AFTER) and calls == []
    w.step(now=60.0 + 5.0 + 2 * CANCEL_AFTER + 1)
    assert calls == ["it outlived its timeout and its coordinator did not stop it"]
