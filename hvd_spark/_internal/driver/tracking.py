"""MLflow tracking of a fit (optional: ``pip install 'hvd_spark[mlflow]'``).

Where it logs:
- an MLflow run active on the driver (``with mlflow.start_run(): est.fit(df)``, or the run that
  ``mlflow.pyspark.ml.autolog()`` opens around ``fit``): the fit is logged into it;
- the same run again (tuning, repeated fits in one ``with`` block): each later fit gets a nested
  child run, so that params of different fits never clash;
- no active run: nothing with ``mlflow="auto"``; a new run, ended with the fit, with ``"on"``.

What it logs: the estimator's params (objects by class and config, not by ``repr``), tags with
hvd_spark's run id and store paths, each epoch's rank-averaged metrics as rank 0 reports them
(``step`` = epoch), a fit summary (seconds, restarts), and the trained model as an MLflow Keras
model with a signature from the model's input and output specs.

Metric events arrive on the driver service's thread: everything after the start goes through an
``MlflowClient`` with the run id, never through MLflow's thread-local active-run stack.
"""

import logging
import sys
import time
from typing import Any

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


class FitTracker:
    """One fit's MLflow run: opened after the checks, fed epoch events, closed with the model or the error."""

    def __init__(self, mlflow, run_id: str, owned: bool):
        self.mlflow = mlflow
        self.client = mlflow.MlflowClient()
        self.run_id = run_id
        self.owned = owned  # started here (ended here too)
        self.logged_epochs: set[int] = set()

    @classmethod
    def open(cls, mode: str, params: dict, tags: dict[str, str]) -> "FitTracker | None":
        """Starts tracking (or returns None: mode 'off', MLflow missing, no active run with 'auto')."""
        if mode == "off":
            return None
        # 'auto' logs into the caller's active run, which only exists where the caller imported MLflow:
        # importing it here (a second or more) just to find no run would slow every fit down.
        mlflow = sys.modules.get("mlflow") if mode == "auto" else _mlflow()
        if mlflow is None:
            return None
        active = mlflow.active_run()
        if active is None and mode == "auto":
            return None
        owned = active is None
        if active is not None:
            seen = mlflow.MlflowClient().get_run(active.info.run_id).data.tags
            if TAG_PREFIX + "run_id" in seen:  # an earlier fit logged into this run: a child run for this one
                owned = True
        run = mlflow.start_run(nested=active is not None) if owned else active
        tracker = cls(mlflow, run.info.run_id, owned)
        try:
            existing = tracker.client.get_run(tracker.run_id).data.params
            fresh = {k: v for k, v in param_values(params).items() if k not in existing}  # autolog's win
            tracker._log(params=fresh, tags={TAG_PREFIX + k: str(v) for k, v in tags.items()})
        except Exception:
            tracker.close(error=True)
            raise
        logger.info("MLflow: tracking this fit in run %s", tracker.run_id)
        return tracker

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
        """The estimator's progress listener: each epoch's metrics, logged as they arrive."""
        if payload.get("kind") != "epoch":
            return
        try:
            self._log(metrics=payload["logs"], step=int(payload["epoch"]))
            self.logged_epochs.add(int(payload["epoch"]))
        except Exception as e:  # tracking must never stop training; the gap is filled at close
            logger.warning("MLflow: could not log epoch %s (%s); will retry at the end", payload.get("epoch"), e)

    def close(self, error: bool = False, epoch_logs=None, summary: dict | None = None, model=None, sig=None) -> None:
        """Logs what the epoch events missed (earlier attempts, a resumed run's epochs), the summary and
        the model; ends the run if it was started here."""
        try:
            if not error:
                for epoch, logs in enumerate(epoch_logs or [], start=1):
                    if epoch not in self.logged_epochs:
                        self._log(metrics=logs, step=epoch)
                self._log(metrics=summary or {})
                if model is not None:
                    self._log_model(model, sig)
            else:
                self._log(tags={TAG_PREFIX + "status": "FAILED"})
        finally:
            if self.owned:
                self.mlflow.end_run("FAILED" if error else "FINISHED")

    def _log_model(self, model, sig) -> None:
        import keras
        import tensorflow as tf
        from mlflow import keras as mlflow_keras

        # Requirements are given, not inferred (inference loads the model in a subprocess and may
        # reach for the network).
        reqs = [f"keras=={keras.__version__}", f"tensorflow=={tf.__version__}"]
        active = self.mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            with self.mlflow.start_run(run_id=self.run_id, nested=active is not None):
                mlflow_keras.log_model(model, name="model", signature=sig, pip_requirements=reqs)
        else:
            mlflow_keras.log_model(model, name="model", signature=sig, pip_requirements=reqs)
