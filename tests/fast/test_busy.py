"""``events.busy``: a long operation that makes no steps counts as progress for the stall watchdog
while it runs, up to its limit, and not after it ends; its ticks keep a rank alive without moving
its marks (the order of a stall report)."""

import threading
import time

import pytest

from hvd_spark._internal.common import events, settings
from hvd_spark._internal.common.events import busy, mark_progress
from hvd_spark._internal.common.service import KIND, DriverService, Kind, TaskClient


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _busy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hvd_spark-busy"]


def _still(seconds: float = 0.5) -> bool:
    """Whether the progress count stands still for ``seconds``."""
    before = events._progress.count
    time.sleep(seconds)
    return events._progress.count == before


@pytest.fixture
def progress(monkeypatch):
    """A fresh counter outside an hvd_spark job (nothing is sent)."""
    monkeypatch.delenv(settings.ENV_DRIVER_ADDR, raising=False)
    fresh = events._Progress()
    monkeypatch.setattr(events, "_progress", fresh)
    yield fresh
    assert not events._busy_blocks and not _busy_threads()


@pytest.fixture
def fast(monkeypatch):
    """Ticks every 0.05 s, so that limits and ends are seen quickly."""
    monkeypatch.setattr(events, "BUSY_INTERVAL", 0.05)


def test_a_busy_block_ticks_every_second_while_it_runs_and_not_after(progress):
    with busy("uploading the checkpoint of epoch 3"):
        assert progress.count == 1 and progress.where == "uploading the checkpoint of epoch 3"  # at once
        _until(lambda: progress.count >= 2)  # a tick from the thread, about a second later
        assert progress.marks == 0  # alive, no step further
        assert len(_busy_threads()) == 1
    assert not _busy_threads()  # stopped and joined on exit
    assert progress.where == "after uploading the checkpoint of epoch 3"
    mark_progress("epoch 4 step 1")
    assert progress.marks == 1 and progress.where == "epoch 4 step 1"


def test_no_tick_after_a_busy_block(progress, fast):
    with busy("uploading"):
        _until(lambda: progress.count >= 3)
    count = progress.count
    assert _still()  # ten intervals
    assert progress.count == count and progress.marks == 0


def test_a_busy_block_stops_ticking_after_its_limit(progress, fast):
    with busy("the first step", limit=1.0):
        _until(lambda: progress.count >= 3)  # ticking within the limit
        _until(lambda: not _busy_threads())  # past the limit its thread ends ...
        assert _still()  # ... and the block, still running, no longer counts as progress
        assert progress.where == "the first step"  # the place the stall report quotes
    assert progress.where == "after the first step"


def test_a_busy_block_stops_its_thread_when_its_body_raises(progress, fast):
    with pytest.raises(RuntimeError, match="upload failed"), busy("uploading"):
        _until(lambda: progress.count >= 2)
        raise RuntimeError("upload failed")
    assert not _busy_threads() and not events._busy_blocks
    assert _still()


def test_busy_blocks_nest_each_for_its_own_limit(progress, fast):
    with busy("saving the checkpoint"):
        with busy("uploading the model", limit=1.0):
            _until(lambda: progress.where == "uploading the model" and progress.count >= 3)
            assert len(_busy_threads()) == 2
            _until(lambda: len(_busy_threads()) == 1)  # the inner block passed its limit
            count = progress.count
            _until(lambda: progress.count > count + 1)  # the outer one still ticks, naming itself
            assert progress.where == "saving the checkpoint"
        assert progress.where == "saving the checkpoint"
        count = progress.count
        _until(lambda: progress.count > count + 1)
    assert progress.where == "after saving the checkpoint" and progress.marks == 0
    assert _still()


def test_a_busy_limit_must_be_a_positive_number_of_seconds(progress):
    for bad in (0, -1.0, True):
        with (
            pytest.raises(ValueError, match="limit must be None or a number of seconds greater than 0"),
            busy("x", limit=bad),
        ):
            pass
    assert progress.count == 0  # nothing ticked, nothing left open


def test_busy_ticks_reach_the_driver_as_count_without_marks(monkeypatch, fast):
    """In a job: the rank's thread sends the count and the marks; the driver's count moves with a
    busy block's ticks, its marks only with mark_progress."""
    monkeypatch.setattr(settings, "PROGRESS_INTERVAL", 0.05)  # the rank's sender, read on each round
    svc = DriverService(1, bind="127.0.0.1")
    svc.start()
    task = TaskClient(f"127.0.0.1:{svc.port}", svc.token, {"role": "task", "partition": 0})
    monkeypatch.setenv(settings.ENV_DRIVER_ADDR, f"127.0.0.1:{svc.port}")
    monkeypatch.setenv(settings.ENV_JOB_TOKEN, svc.token)
    monkeypatch.setenv(settings.ENV_RANK, "0")
    monkeypatch.setattr(events, "_progress", events._Progress())
    monkeypatch.setattr(events, "_client", None)
    try:
        task.send({KIND: Kind.RANK, "rank": 0})
        _until(lambda: 0 in svc.progress)
        mark_progress("epoch 1 step 1")
        _until(lambda: svc.progress[0][1:] == (1, "epoch 1 step 1", 1))
        with busy("uploading the checkpoint of epoch 1"):
            _until(lambda: svc.progress[0][1] >= 4)  # the entry tick and the thread's
            _, count, where, marks = svc.progress[0]
            assert where == "uploading the checkpoint of epoch 1" and marks == 1
        mark_progress("epoch 2 step 1")
        _until(lambda: svc.progress[0][2:] == ("epoch 2 step 1", 2))
    finally:
        if events._client is not None:
            events._client.close()
        task.close()
        svc.stop()
