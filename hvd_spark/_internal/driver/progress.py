"""Driver side of a fit's progress: each epoch's metrics in the ``hvd_spark`` log, and a live bar
(step within the epoch, ETA, rank 0's running metrics) when a person is watching.

The bar is drawn where it can be redrawn in place: a terminal (stderr is a TTY) or a Jupyter /
IPython kernel. ``HVD_SPARK_PROGRESS=1`` / ``0`` forces it on / off (logs of batch jobs stay free
of carriage returns by default).
"""

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from hvd_spark._internal.common import settings

logger = logging.getLogger(__name__)

BAR_WIDTH = 24
BATCH_INTERVAL = settings.PROGRESS_BATCH_INTERVAL  # seconds between rank 0's in-epoch events while the bar is shown


def interactive(stream: TextIO | None = None) -> bool:
    """Whether a live bar can be shown: forced by HVD_SPARK_PROGRESS, else a TTY or a notebook kernel."""
    forced = settings.PROGRESS.get()
    if forced is not None:
        return forced
    stream = stream or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return True
    shell = sys.modules.get("IPython")
    get_ipython = getattr(shell, "get_ipython", None) if shell else None
    return bool(get_ipython and get_ipython() is not None and "ipykernel" in sys.modules)


def _duration(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def render_bar(epoch: int, epochs: int, step: int, steps: int | None, eta: float | None, logs: dict) -> str:
    """One line: ``epoch 2/5 [=========>      ] 120/250 ETA 0:14 - loss: 0.3125``."""
    if steps:
        done = min(BAR_WIDTH, int(BAR_WIDTH * step / steps))
        bar = "=" * done + (">" if done < BAR_WIDTH else "") + " " * (BAR_WIDTH - done - 1)
        where = f"[{bar[:BAR_WIDTH]}] {step}/{steps}"
    else:
        where = f"step {step}"
    parts = [f"epoch {epoch}/{epochs} {where}"]
    if eta is not None:
        parts.append(f"ETA {_duration(eta)}")
    line = " ".join(parts)
    metrics = " - ".join(f"{k}: {v:.4f}" for k, v in sorted(logs.items()))
    return f"{line} - {metrics}" if metrics else line


class FitProgress:
    """The estimator's ``on_event`` callback: logs each epoch's metrics (verbose >= 1) and draws the
    bar from rank 0's batch events (``bar``); ``listeners`` get every event (MLflow, say)."""

    def __init__(
        self,
        verbose: int,
        bar: bool,
        stream: TextIO | None = None,
        listeners: "list[Callable[[int, dict], None]] | None" = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.verbose = verbose
        self.bar = bar and verbose > 0
        self.stream = stream or sys.stderr
        self.listeners = list(listeners or [])
        self.clock = clock
        self.epoch_start = self.last_epoch_end = clock()
        self.epoch_seconds: list[float] = []
        self._drawn = 0  # length of the bar line on screen (0: none)
        self._epoch = 0

    def __call__(self, rank: int, payload: dict) -> None:
        for listen in self.listeners:
            listen(rank, payload)
        kind = payload.get("kind")
        if kind == "start":
            self.epoch_start = self.last_epoch_end = self.clock()
        elif kind == "batch" and self.bar:
            self._draw(payload)
        elif kind == "epoch":
            self._epoch_end(payload)

    def _eta(self, p: dict, now: float) -> float | None:
        steps, step = p.get("steps"), p["step"]
        if not steps or step <= 0:
            return None
        per_epoch = (now - self.epoch_start) * steps / step
        if self.epoch_seconds:  # later epochs: what whole epochs took, steadier than the current one
            per_epoch = sum(self.epoch_seconds[-3:]) / len(self.epoch_seconds[-3:])
            left_this = per_epoch * (steps - step) / steps
        else:
            left_this = (now - self.epoch_start) * (steps - step) / step
        return left_this + per_epoch * max(0, p["epochs"] - p["epoch"])

    def _draw(self, p: dict) -> None:
        now = self.clock()
        if p["epoch"] != self._epoch:
            self._epoch = p["epoch"]
            self.epoch_start = self.last_epoch_end
        line = render_bar(p["epoch"], p["epochs"], p["step"], p.get("steps"), self._eta(p, now), p.get("logs", {}))
        pad = " " * max(0, self._drawn - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._drawn = len(line)

    def _epoch_end(self, p: dict) -> None:
        now = self.clock()
        took = now - self.last_epoch_end
        self.epoch_seconds.append(took)
        self.last_epoch_end = self.epoch_start = now
        if self._drawn:  # end the bar's line before the log line
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
        if self.verbose:
            logs = " - ".join(f"{k}: {v:.4f}" for k, v in sorted(p["logs"].items()))
            logger.info("epoch %d/%d - %.1fs - %s", p["epoch"], p["epochs"], took, logs)
