"""MLflow tracking never holds up a fit (driver/tracking.py), without MLflow: the tracker's thread takes
epoch events from a bounded queue without ever blocking the caller, drops (and counts) what a full
queue cannot take, drops itself after MLflow's first error, and bounds the waits of the fit's end.
The calls here stand in for MLflow's: one that blocks plays a tracking server that never answers."""

import logging
import threading
import time

import pytest

from hvd_spark._internal.driver.tracking import FitTracker, _Calls, _epochs_text, _NoAnswer


def _hung():
    """A call that blocks until released: a server that never answers."""
    release = threading.Event()
    return release, lambda: release.wait(30)


def test_events_never_block_and_a_full_queue_drops_and_counts(caplog):
    calls = _Calls(max_events=3)
    release, hang = _hung()
    done: list[int] = []
    started = threading.Event()
    calls.post(lambda: (started.set(), hang()), "epoch 1's metrics")
    assert started.wait(5)  # the thread took it, and hangs
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        posted = [calls.post(lambda e=e: done.append(e), f"epoch {e}'s metrics") for e in range(2, 8)]
    assert time.monotonic() - t0 < 0.5  # never waits for the server
    assert posted == [True, True, True, False, False, False] and calls.dropped == 3
    assert calls.waiting() == [f"epoch {e}'s metrics" for e in range(1, 5)]
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1  # logged once
    release.set()
    assert calls.call(lambda: "after", "the end", timeout=5) == "after"  # in order, behind the events
    assert done == [2, 3, 4]
    calls.stop()
    assert calls.join(5)


def test_the_first_error_drops_the_tracker_and_later_events_are_ignored(caplog):
    calls = _Calls()
    done: list[int] = []

    def fail():
        raise ConnectionError("the server went away")

    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        calls.post(fail, "epoch 1's metrics")
        calls.post(lambda: done.append(2), "epoch 2's metrics")
        assert calls.call(lambda: "end", "the end", timeout=5) == "end"  # the end is still tried
        assert calls.post(lambda: done.append(3), "epoch 3's metrics") is False
    assert done == [] and isinstance(calls.failure, ConnectionError)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "epoch 1's metrics failed" in warning and "the server went away" in warning and "goes on" in warning
    calls.stop()
    assert calls.join(5)


def test_a_call_that_does_not_answer_times_out_and_its_error_comes_back():
    calls = _Calls()
    release, hang = _hung()
    t0 = time.monotonic()
    with pytest.raises(_NoAnswer, match="starting the run: no answer within 0.2s"):
        calls.call(hang, "starting the run", timeout=0.2)
    assert time.monotonic() - t0 < 2
    release.set()
    with pytest.raises(ValueError, match="bad"):
        calls.call(lambda: (_ for _ in ()).throw(ValueError("bad")), "x", timeout=5)
    calls.stop()
    assert calls.join(5)


def test_the_end_of_a_fit_waits_at_most_the_timeout_and_says_what_was_not_logged(caplog):
    """A server that hangs from epoch 2 on: epoch 1 was logged as it came; the fit's end returns after
    the timeout, naming the epochs and the summary as not logged."""
    release, hang = _hung()
    logged: list[dict] = []

    def log(metrics=None, **_):
        if logged:  # the second call on hangs
            hang()
        logged.append(metrics or {})

    tracker = FitTracker(mlflow=None, timeout=0.5)
    tracker.run_id = "r1"
    tracker._log = log  # type: ignore[method-assign]
    for epoch in (1, 2, 3):
        tracker.on_event(0, {"kind": "epoch", "epoch": epoch, "logs": {"loss": 1.0 / epoch}})
    tracker.on_event(0, {"kind": "batch", "epoch": 3})  # not an epoch: not queued
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        tracker.close(epoch_logs=[{"loss": 1.0}, {"loss": 0.5}, {"loss": 1 / 3}], summary={"fit_seconds": 1.0})
    assert 0.4 < time.monotonic() - t0 < 3
    assert logged == [{"loss": 1.0}] and tracker.logged_epochs == {1}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "HVD_SPARK_MLFLOW_TIMEOUT" in warning
    assert "not logged: the metrics of epoch(s) 2-3, the summary." in warning, warning
    release.set()
    assert tracker._calls.join(5)


def test_epochs_text():
    assert _epochs_text([5, 1, 2, 3, 7, 8]) == "1-3, 5, 7-8" and _epochs_text([4]) == "4"
