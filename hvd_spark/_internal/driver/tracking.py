"""MLflow tracking of a fit (optional: ``pip install 'hvd_spark[mlflow]'``).

Where it logs:
- an MLflow run active on the driver (``with mlflow.start_run(): est.fit(df)``, or the run that
  ``mlflow.pyspark.ml.autolog()`` opens around ``fit``): the fit is logged into it;
- the same run again (tuning, repeated fits in one ``with`` block): each later fit gets a nested
  child run, so that params of different fits never clash;
- no active run: nothing with ``mlflow="auto"``; a new run, ended with the fit, with ``"on"``.

What it logs: the estimator's params (objects by class and config, not by ``repr``), tags with
hvd_spark's run id and store paths, each epoch's metrics (over all ranks' rows) as rank 0 reports them
(``step`` = epoch), a fit summary (seconds, restarts), and the trained model as an MLflow Keras
model with a signature from the model's input and output specs.

Tracking never holds up the fit. Every MLflow call of a fit runs on the tracker's own daemon thread
(:class:`_Calls`), in order: the epoch events (which arrive on the driver service's thread that reads
rank 0's messages) are only queued there, in a bounded queue (full: the event is dropped, counted and
logged once; its epoch is filled in at the end); the opening and the end are waited for at most
``HVD_SPARK_MLFLOW_TIMEOUT`` seconds each, then the fit goes on (untracked) or returns its model, with
a warning naming what was not logged. An error from MLflow is a warning too: after the first failed
epoch the tracker sends no more epochs as they arrive (the end is still tried once). Everything goes
through an ``MlflowClient`` with the run id; a run the fit starts is started (and ended) on the
tracker's thread, whose active-run stack is its own: the caller's stack is never changed.
"""

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.choices import MLFLOW_MODES as MODES

logger = logging.getLogger(__name__)

TAG_PREFIX = "hvd_spark."
_MAX_PARAM = 500  # characters of a param's value (MLflow's limit is 6000)


def check_mode(value) -> str:
    """The ``mlflow`` param as 'auto' | 'on' | 'off' (True / False / None accepted), checked before any work."""
    mode = {True: "on", False: "off", None: "auto"}.get(value, value) if not isinstance(value, str) else value.lower()
    if mode not in MODES:
        raise ValueError(f"mlflow must be 'auto', 'on' or 'off' (or True / False). Received: mlflow={value!r}.")
    if mode == "on" and _mlflow() is None:
        raise ImportError("mlflow='on' needs MLflow on the driver: pip install 'hvd_spark[mlflow]'.")
    return mode


def _mlflow():
    try:
        import mlflow
    except ImportError:
        return None
    return mlflow


def describe(value) -> str:
    """A param's value as a short, stable string: objects by class (and Keras config), not by address."""
    if isinstance(value, float):
        return f"{value:.7g}"  # float32 settings read back as 0.009999999776 otherwise
    if value is None or isinstance(value, (bool, int, str)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    name = type(value).__name__
    if name in ("Store",) and hasattr(value, "prefix"):  # never its storage options (credentials)
        from hvd_spark._internal.common.secrets import url_without_credentials

        return url_without_credentials(str(value.prefix))
    get_config = getattr(value, "get_config", None)
    if callable(get_config) and not hasattr(value, "layers"):  # optimizers, losses, metrics: their settings
        try:
            config = get_config()
        except Exception:  # a custom object whose config is not serializable: the class says enough
            return name
        keep = {k: v for k, v in config.items() if isinstance(v, (bool, int, float, str)) and k != "name"}
        return f"{name}({', '.join(f'{k}={describe(v)}' for k, v in sorted(keep.items()))})"
    if hasattr(value, "layers") and hasattr(value, "count_params"):  # a Keras model
        return f"{name}(name={value.name}, params={value.count_params()})"
    return name


def param_values(params: dict[str, Any]) -> dict[str, str]:
    """The estimator's params for MLflow: every one that is set, described, cut to a safe length."""
    out = {}
    for k, v in params.items():
        if k in ("custom_objects",) or v is None:
            continue
        text = describe(v)
        if k == "store":  # a URL given as a string: no password in it either
            from hvd_spark._internal.common.secrets import url_without_credentials

            text = url_without_credentials(text)
        out[k] = text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 3] + "..."
    return out


def signature(inputs, outputs):
    """An MLflow tensor signature from hvd_spark's TensorSpecs (batch axis -1; dict keys as names)."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    def schema(specs):
        return Schema(
            [
                TensorSpec(np.dtype(s.dtype), (-1, *[d if d is not None else -1 for d in s.shape]), s.key or s.name)
                for s in specs
            ]
        )

    return ModelSignature(inputs=schema(inputs), outputs=schema(outputs))


MAX_QUEUED_EVENTS = (
    100  # epoch events waiting for a slow server at most; later ones are dropped (and filled in at the end)
)


class _NoAnswer(Exception):
    """A call of the tracker's thread did not finish within its timeout (it goes on in the background)."""


class _Job:
    """One call for the tracker's thread: ``fn``, what it logs (for messages), its outcome."""

    def __init__(self, fn: Callable[[], Any], what: str, event: bool):
        self.fn, self.what, self.event = fn, what, event
        self.done = threading.Event()
        self.result: Any = None
        self.error: Exception | None = None


class _Calls:
    """A tracker's own daemon thread, which makes the MLflow calls of one fit in order, so that a slow
    or hung tracking server never holds up the thread that hands it work.

    :meth:`post` queues an epoch event's call and never blocks: with ``max_events`` of them already
    waiting, the new one is dropped and counted (a warning the first time). :meth:`call` queues a call
    behind everything before it and waits for it at most ``timeout`` seconds. The first error of an
    event's call is a warning, and the events after it are ignored (the tracker is dropped); a
    :meth:`call` gets its own error back."""

    def __init__(self, max_events: int = MAX_QUEUED_EVENTS):
        self.max_events = max_events
        self.dropped = 0  # events not queued: max_events were waiting
        self.failure: Exception | None = None  # the first error of an event's call
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job | None] = collections.deque()  # None: stop
        self._events = 0  # event calls in the queue
        self._current: _Job | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="hvd_spark-mlflow")
        self._thread.start()

    def post(self, fn: Callable[[], Any], what: str) -> bool:
        """Queues an event's call; False when it was not queued (the queue is full, or an earlier event failed)."""
        with self._cond:
            if self.failure is not None:
                return False
            if self._events >= self.max_events:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "MLflow: %d events are waiting for the tracking server; later ones are dropped "
                        "while it is behind (their epochs' metrics are logged at the end of the fit)",
                        self._events,
                    )
                return False
            self._jobs.append(_Job(fn, what, event=True))
            self._events += 1
            self._cond.notify()
        return True

    def then(self, fn: Callable[[], Any], what: str) -> _Job:
        """Queues a call behind everything queued before it, without waiting for it."""
        job = _Job(fn, what, event=False)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()
        return job

    def call(self, fn: Callable[[], Any], what: str, timeout: float) -> Any:
        """Runs ``fn`` on the thread after what is queued before it and returns its result (or raises
        its error); raises :class:`_NoAnswer` when it has not finished after ``timeout`` seconds (it
        still runs, in the background)."""
        job = self.then(fn, what)
        if not job.done.wait(timeout):
            raise _NoAnswer(f"{what}: no answer within {timeout:g}s")
        if job.error is not None:
            raise job.error
        return job.result

    def waiting(self) -> list[str]:
        """What is not done yet, in order: the call in progress, then the queued ones."""
        with self._cond:
            jobs = [self._current, *self._jobs]
        return [j.what for j in jobs if j is not None]

    def stop(self) -> None:
        """Ends the thread once what is queued is done."""
        with self._cond:
            self._jobs.append(None)
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread to end (after :meth:`stop`); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
                if job is None:
                    return
                if job.event:
                    self._events -= 1
                    if self.failure is not None:  # the tracker was dropped: events are ignored
                        job.done.set()
                        continue
                self._current = job
            try:
                job.result = job.fn()
            except Exception as e:
                job.error = e
                if job.event:
                    with self._cond:
                        self.failure = e
                    logger.warning(
                        "MLflow: logging %s failed (%s: %s); the fit goes on, and sends no more epochs to "
                        "MLflow as they arrive (the end of the fit is still logged if MLflow answers then)",
                        job.what,
                        type(e).__name__,
                        e,
                    )
                else:
                    logger.debug("MLflow: %s failed: %s", job.what, e)
            finally:
                with self._cond:
                    self._current = None
                job.done.set()


def _epochs_text(epochs: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``"1-3, 5"``."""
    spans: list[list[int]] = []
    for e in sorted(epochs):
        if spans and e == spans[-1][1] + 1:
            spans[-1][1] = e
        else:
            spans.append([e, e])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


class FitTracker:
    """One fit's MLflow run: opened after the checks, fed epoch events, closed with the model or the
    error. Every MLflow call runs on the tracker's thread (:class:`_Calls`); the fit waits for the
    opening and the end at most ``timeout`` seconds each (``HVD_SPARK_MLFLOW_TIMEOUT``) and never for
    an epoch."""

    def __init__(self, mlflow, timeout: float, calls: _Calls | None = None):
        self.mlflow = mlflow
        self.timeout = timeout
        self.client: Any = None
        self.run_id = ""
        self.owned = False  # started here (ended here too)
        self.logged_epochs: set[int] = set()
        self._ended: set[str] = set()  # what the end of the fit logged: "summary", "model", "run"
        self._calls = calls if calls is not None else _Calls()

    @classmethod
    def open(cls, mode: str, params: dict, tags: dict[str, str]) -> "FitTracker | None":
        """Starts tracking (or returns None: mode 'off', MLflow missing, no active run with 'auto', or
        MLflow failed or did not answer within the timeout: a warning, and the fit trains untracked)."""
        if mode == "off":
            return None
        # 'auto' logs into the caller's active run, which only exists where the caller imported MLflow:
        # importing it here (a second or more) just to find no run would slow every fit down.
        mlflow = sys.modules.get("mlflow") if mode == "auto" else _mlflow()
        if mlflow is None:
            return None
        active = mlflow.active_run()  # the caller's thread's run (no call to the server)
        if active is None and mode == "auto":
            return None
        parent = active.info.run_id if active is not None else None
        values = param_values(params)  # here: the objects (a Keras model) stay on the fit's thread
        tracker = cls(mlflow, settings.MLFLOW_TIMEOUT.get())
        try:
            tracker._calls.call(lambda: tracker._start(parent, values, tags), "starting the run", tracker.timeout)
        except _NoAnswer:
            logger.warning(
                "MLflow: the tracking server (%s) did not answer within %gs (%s) while the fit started its "
                "run: this fit is not tracked",
                _tracking_uri(mlflow),
                tracker.timeout,
                settings.MLFLOW_TIMEOUT.env,
            )
            tracker._calls.then(tracker._abandon, "ending the run of a fit that went on untracked")
            tracker._calls.stop()
            return None
        except Exception as e:
            logger.warning("MLflow: starting to track this fit failed (%s: %s): it is not tracked", type(e).__name__, e)
            tracker._calls.stop()
            return None
        logger.info("MLflow: tracking this fit in run %s", tracker.run_id)
        return tracker

    def _start(self, parent: str | None, values: dict[str, str], tags: dict[str, str]) -> None:
        """On the tracker's thread: the run this fit logs into, with its params and tags."""
        self.client = self.mlflow.MlflowClient()
        owned = parent is None or TAG_PREFIX + "run_id" in self.client.get_run(parent).data.tags
        if owned:  # no active run, or an earlier fit logged into it: a (child) run for this one
            # Started on this thread, whose active-run stack is its own (the caller's is left as it was).
            self.run_id = self.mlflow.start_run(parent_run_id=parent).info.run_id
            self.owned = True
        else:
            assert parent is not None
            self.run_id = parent
        try:
            existing = self.client.get_run(self.run_id).data.params
            fresh = {k: v for k, v in values.items() if k not in existing}  # autolog's win
            self._log(params=fresh, tags={TAG_PREFIX + k: str(v) for k, v in tags.items()})
        except Exception:
            if self.owned:
                try:
                    self.mlflow.end_run("FAILED")
                except Exception as e:  # the first error says more
                    logger.debug("MLflow: ending run %s failed: %s", self.run_id, e)
            raise

    def _abandon(self) -> None:
        """On the tracker's thread, after an opening that timed out: ends the run it started late."""
        if self.owned and self.mlflow.active_run() is not None:
            self.mlflow.end_run("KILLED")

    def _log(self, params=None, tags=None, metrics=None, step=0):
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
            params=[Param(k, v) for k, v in (params or {}).items()],
            tags=[RunTag(k, v) for k, v in (tags or {}).items()],
        )

    def on_event(self, rank: int, payload: dict) -> None:
        """The estimator's progress listener: each epoch's metrics, queued for the tracker's thread
        (never waits; see :class:`_Calls`)."""
        if payload.get("kind") != "epoch":
            return
        self._calls.post(lambda: self._log_epoch(payload), f"epoch {payload.get('epoch')}'s metrics")

    def _log_epoch(self, payload: dict) -> None:
        epoch = int(payload["epoch"])
        self._log(metrics=payload["logs"], step=epoch)
        self.logged_epochs.add(epoch)

    def close(self, error: bool = False, epoch_logs=None, summary: dict | None = None, model=None, sig=None) -> None:
        """Logs what the epoch events missed (earlier attempts, a resumed run's epochs, events that
        failed or were dropped), the summary and the model; ends the run if it was started here.
        Waits for the queued epochs and these at most ``timeout`` seconds; never raises: past the
        timeout, or on an error from MLflow, a warning says what was not logged."""
        epochs = len(epoch_logs or [])

        def end() -> None:
            try:
                if not error:
                    for epoch, logs in enumerate(epoch_logs or [], start=1):
                        if epoch not in self.logged_epochs:
                            self._log(metrics=logs, step=epoch)
                            self.logged_epochs.add(epoch)
                    self._log(metrics=summary or {})
                    self._ended.add("summary")
                    if model is not None:
                        self._log_model(model, sig)
                        self._ended.add("model")
                else:
                    self._log(tags={TAG_PREFIX + "status": "FAILED"})
                    self._ended.add("status")
            finally:
                if self.owned:
                    self.mlflow.end_run("FAILED" if error else "FINISHED")
                    self._ended.add("run")

        try:
            self._calls.call(end, "the end of the fit", self.timeout)
        except _NoAnswer:
            missing = [e for e in range(1, epochs + 1) if e not in self.logged_epochs]
            left = [f"the metrics of epoch(s) {_epochs_text(missing)}"] if missing and not error else []
            left += [f"the {what}" for what in ("summary", "model") if not error and what not in self._ended]
            if error and "status" not in self._ended:
                left.append(f"the tag {TAG_PREFIX}status=FAILED")
            if model is None and "the model" in left:
                left.remove("the model")
            ended = "" if not self.owned or "run" in self._ended else "; the run is left RUNNING"
            logger.warning(
                "MLflow: run %s did not answer within %gs (%s) at the end of the fit; not logged: %s%s. The "
                "fit goes on; MLflow still gets them if it answers while this process runs",
                self.run_id,
                self.timeout,
                settings.MLFLOW_TIMEOUT.env,
                ", ".join(left) or "nothing",
                ended,
            )
        except Exception as e:
            logger.warning("MLflow: logging the fit's end to run %s failed: %s", self.run_id, e, exc_info=True)
        finally:
            self._calls.stop()

    def _log_model(self, model, sig) -> None:
        import keras
        import tensorflow as tf
        from mlflow import keras as mlflow_keras
        from mlflow.models import Model

        # Requirements are given, not inferred (inference loads the model in a subprocess and may
        # reach for the network). Model.log with the run id (what mlflow.keras.log_model does for the
        # active run): this thread's active run is not the caller's.
        reqs = [f"keras=={keras.__version__}", f"tensorflow=={tf.__version__}"]
        Model.log(
            artifact_path=None,
            name="model",
            flavor=mlflow_keras,
            run_id=self.run_id,
            model=model,
            signature=sig,
            pip_requirements=reqs,
        )


def _tracking_uri(mlflow) -> str:
    from hvd_spark._internal.common.secrets import url_without_credentials

    try:
        return url_without_credentials(str(mlflow.get_tracking_uri()))
    except Exception:  # only for a message
        return "?"
