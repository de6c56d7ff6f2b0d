"""The driver's progress display: the bar's line, its ETA, the epoch log lines, when it is drawn."""

import io
import logging

import pytest

from hvd_spark._internal.driver import progress
from hvd_spark._internal.driver.progress import FitProgress, interactive, render_bar


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _batch(epoch, step, steps=10, epochs=3, loss=0.5):
    return {"kind": "batch", "epoch": epoch, "epochs": epochs, "step": step, "steps": steps, "logs": {"loss": loss}}


def _epoch(epoch, epochs=3, loss=0.25):
    return {"kind": "epoch", "epoch": epoch, "epochs": epochs, "logs": {"loss": loss, "val_loss": 0.5}}


def test_bar_line_shows_position_eta_and_metrics():
    line = render_bar(2, 5, 5, 10, 74.4, {"loss": 0.3125, "accuracy": 0.9})
    assert line.startswith("epoch 2/5 [============>           ] 5/10 ETA 1:14")
    assert line.endswith("accuracy: 0.9000 - loss: 0.3125")
    assert "[" + "=" * progress.BAR_WIDTH + "] 10/10" in render_bar(1, 1, 10, 10, 0.0, {})
    assert render_bar(1, 1, 7, None, None, {}) == "epoch 1/1 step 7"  # steps unknown: no bar, no ETA
    assert "ETA 1:01:01" in render_bar(1, 1, 1, 2, 3661, {})


def test_eta_from_the_current_epoch_then_from_whole_epochs():
    clock, out = _Clock(), io.StringIO()
    p = FitProgress(1, bar=True, stream=out, clock=clock)
    p(0, {"kind": "start", "rank": 0, "initial_epoch": 0})
    clock.now += 4.0
    p(0, _batch(1, 2))  # 2 of 10 steps in 4 s: 16 s left in this epoch + 2 epochs of 20 s
    assert "ETA 0:56" in out.getvalue().split("\r")[-1]
    clock.now += 16.0
    p(0, _epoch(1))  # the epoch took 20 s
    clock.now += 1.0
    p(0, _batch(2, 5))  # half of an epoch left (10 s) + one epoch (20 s), from the measured epoch
    assert "ETA 0:30" in out.getvalue().split("\r")[-1]


def test_bar_redraws_in_place_and_ends_its_line_before_the_epoch_log(caplog):
    clock, out = _Clock(), io.StringIO()
    p = FitProgress(1, bar=True, stream=out, clock=clock)
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        p(0, _batch(1, 3, loss=0.123456))
        p(0, _batch(1, 10))
        p(0, _epoch(1))
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "loss: 0.1235" in text
    assert [r.getMessage() for r in caplog.records] == ["epoch 1/3 - 0.0s - loss: 0.2500 - val_loss: 0.5000"]


def test_no_bar_when_not_interactive_or_quiet_and_listeners_see_every_event(caplog):
    seen = []
    for verbose, bar in ((1, False), (0, True)):
        out = io.StringIO()
        p = FitProgress(verbose, bar=bar, stream=out, listeners=[lambda r, e: seen.append(e["kind"])])
        with caplog.at_level(logging.INFO, logger="hvd_spark"):
            p(0, _batch(1, 1))
            p(0, _epoch(1))
        assert out.getvalue() == ""
    assert seen == ["batch", "epoch", "batch", "epoch"]
    assert len(caplog.records) == 1  # verbose=0 logs no epoch line


def test_interactive_is_forced_by_the_environment(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("HVD_SPARK_PROGRESS", raising=False)
    assert interactive(Tty()) and not interactive(io.StringIO())
    monkeypatch.setenv("HVD_SPARK_PROGRESS", "0")
    assert not interactive(Tty())
    monkeypatch.setenv("HVD_SPARK_PROGRESS", "1")
    assert interactive(io.StringIO())
    monkeypatch.setenv("HVD_SPARK_PROGRESS", "maybe")
    with pytest.raises(ValueError, match="HVD_SPARK_PROGRESS must be one of"):
        interactive()
