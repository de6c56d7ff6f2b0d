"""MLflow tracking of a fit, against a real local MLflow store (sqlite in a temporary folder): which
run a fit is logged in, what its params look like, how a failed fit ends its run (no Spark), then a
real 2-rank fit on digits whose epochs arrive in the run while it trains, with the model logged and
the live progress bar drawn (HVD_SPARK_PROGRESS=1)."""

import pytest

mlflow = pytest.importorskip("mlflow", reason="the 'mlflow' extra is not installed on this line")

from hvd_spark._internal.driver.tracking import TAG_PREFIX, FitTracker, check_mode, describe, param_values  # noqa: E402


@pytest.fixture()
def tracking(tmp_path):
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    # Artifacts (the logged model) under tmp_path too, not in ./mlruns where the tests run.
    mlflow.set_experiment(
        experiment_id=mlflow.create_experiment("hvd_spark-tests", artifact_location=(tmp_path / "artifacts").as_uri())
    )
    yield mlflow.MlflowClient()
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(before)
    mlflow.tracking.fluent._active_experiment_id = None  # no public way to forget the experiment


def _open(mode, **params):
    return FitTracker.open(mode, {"epochs": 2, **params}, {"run_id": "r1"})


def test_mode_is_checked_first():
    assert [check_mode(v) for v in ("auto", "ON", True, False, None)] == ["auto", "on", "on", "off", "auto"]
    with pytest.raises(ValueError, match="mlflow must be 'auto', 'on' or 'off'"):
        check_mode("yes please")


def test_auto_does_not_import_mlflow_where_the_caller_did_not():
    """'auto' logs into the caller's active run, which needs the caller's own import of MLflow: a fit
    in a process that never imported it does not pay MLflow's import (about a second) to find none."""
    import subprocess
    import sys

    code = (
        "import sys; from hvd_spark._internal.driver.tracking import FitTracker; "
        "assert FitTracker.open('auto', {}, {}) is None; print('mlflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_auto_needs_an_active_run_and_off_never_logs(tracking):
    assert _open("auto") is None and _open("off") is None
    with mlflow.start_run():
        assert _open("off") is None


def test_fit_logs_into_the_active_run_then_later_fits_get_child_runs(tracking):
    with mlflow.start_run() as parent:
        first = _open("auto")
        assert first.run_id == parent.info.run_id and not first.owned
        first.on_event(0, {"kind": "epoch", "epoch": 1, "epochs": 2, "logs": {"loss": 0.5}})
        first.close(epoch_logs=[{"loss": 0.5}, {"loss": 0.25}], summary={"fit_seconds": 1.5})
        second = _open("auto", epochs=3)  # another fit in the same run (a tuning loop): its own child run
        assert second.owned and second.run_id != parent.info.run_id
        second.close(epoch_logs=[])
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the user's run is active again
    run = tracking.get_run(parent.info.run_id)
    assert run.data.params["epochs"] == "2" and run.data.tags[TAG_PREFIX + "run_id"] == "r1"
    history = tracking.get_metric_history(parent.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]  # epoch 2 filled in at the end
    child = tracking.get_run(second.run_id)
    assert child.data.params["epochs"] == "3" and child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.status == "FINISHED"


def test_on_starts_and_ends_its_own_run_and_a_failure_marks_it(tracking):
    t = _open("on")
    assert t.owned and tracking.get_run(t.run_id).info.status == "RUNNING"
    assert mlflow.active_run() is None  # started on the tracker's thread: the caller's active run is as it was
    t.close(error=True)
    assert mlflow.active_run() is None
    run = tracking.get_run(t.run_id)
    assert run.info.status == "FAILED" and run.data.tags[TAG_PREFIX + "status"] == "FAILED"


def test_params_already_in_the_run_are_kept(tracking):
    """mlflow.pyspark.ml.autolog logs the estimator's params itself (by repr): those win, no clash."""
    with mlflow.start_run() as run:
        mlflow.log_param("epochs", "<autolog's value>")
        t = _open("auto", batch_size=16)
        t.close(epoch_logs=[])
    params = tracking.get_run(run.info.run_id).data.params
    assert params["epochs"] == "<autolog's value>" and params["batch_size"] == "16"


def test_params_describe_objects_by_class_and_settings():
    class Opt:
        def get_config(self):
            return {"name": "adam", "learning_rate": 0.009999999776482582, "beta_1": 0.9, "weights": [1, 2]}

    assert describe(Opt()) == "Opt(beta_1=0.9, learning_rate=0.01)"
    assert describe(["a", 1.5, None]) == "[a, 1.5, None]"
    values = param_values({"loss": "mse", "custom_objects": {"f": len}, "run_id": None, "x": "y" * 900})
    assert set(values) == {"loss", "x"} and len(values["x"]) == 500 and values["x"].endswith("...")


def test_a_real_fit_is_tracked_live_with_its_model_and_draws_the_progress_bar(
    spark, tmp_path, tracking, monkeypatch, capsys
):
    import os
    import sys

    import keras
    import numpy as np

    import hvd_spark

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from digits import digits_frames, digits_model

    live: list[set] = []
    close = FitTracker.close

    def spy_close(self, *a, **kw):
        live.append(set(self.logged_epochs))  # the epochs logged from events, before the end fills gaps
        return close(self, *a, **kw)

    monkeypatch.setattr(FitTracker, "close", spy_close)
    monkeypatch.setenv("HVD_SPARK_PROGRESS", "1")
    train, test = digits_frames(spark)
    keras.utils.set_random_seed(1)
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=digits_model(), optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=2, validation=0.2,
    )  # fmt: skip
    with mlflow.start_run() as run:
        model = est.fit(train)
    rid = run.info.run_id
    data = tracking.get_run(rid).data
    assert data.params["epochs"] == "2" and data.params["batch_size"] == "32"
    assert data.params["optimizer"].startswith("Adam(") and "learning_rate=0.01" in data.params["optimizer"]
    assert data.params["feature_cols"] == "[features]" and data.params["run_id"] == model.getRunId()
    assert data.tags[TAG_PREFIX + "run_id"] == model.getRunId()
    assert data.tags[TAG_PREFIX + "model_path"] == model.getModelUrl()
    assert live == [{1, 2}]  # both epochs were logged as rank 0 reported them
    history = model.getHistory()
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        logged = tracking.get_metric_history(rid, name)
        assert [m.step for m in logged] == [1, 2], name
        assert [m.value for m in logged] == pytest.approx(history[name]), name
    assert data.metrics["restarts"] == 0 and {"fit_seconds", "train_job_seconds"} <= set(data.metrics)

    (logged_model,) = mlflow.search_logged_models(filter_string=f"source_run_id = '{rid}'", output_format="list")
    info = mlflow.models.get_model_info(logged_model.model_uri)
    (spec,) = info.signature.inputs.inputs
    assert tuple(spec.shape) == (-1, *est.getModel().input_shape[1:])
    rows = test.limit(20).toPandas()
    x = np.stack(rows["features"].to_numpy()).reshape(-1, 8, 8, 1).astype("float32")
    served = mlflow.keras.load_model(logged_model.model_uri).predict(x, verbose=0)
    np.testing.assert_allclose(served, model.getModel().predict(x, verbose=0), atol=1e-6)

    err = capsys.readouterr().err
    bars = [line for line in err.split("\r") if line.startswith("epoch ")]
    assert any(b.startswith("epoch 1/2 [") for b in bars) and any(b.startswith("epoch 2/2 [") for b in bars), err
    assert all(" ETA " in b for b in bars if "/2 [" in b)


class _HangingTracker:
    """An MLflow tracking server (HTTP) that hangs: it accepts every connection and never answers.
    With ``answer_opening``, it first answers what a fit's opening asks (create the run, read it,
    log the params and tags), then hangs from the first metrics it is sent: a server that goes
    unresponsive while the fit trains. ``release()`` lets the held connections go (closed, no answer)."""

    def __init__(self, answer_opening: bool):
        import http.server
        import json
        import threading

        self.answer_opening, self.hanging, self.held = answer_opening, not answer_opening, 0
        self._released = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, body: bytes):
                if not server.hanging and self.path.split("?")[0].endswith("/log-batch"):
                    server.hanging = bool(json.loads(body or b"{}").get("metrics"))
                if server.hanging:
                    server.held += 1
                    server._released.wait()  # hold the connection, never answer
                    self.close_connection = True
                    return
                run = {
                    "info": {"run_id": "f" * 32, "run_uuid": "f" * 32, "experiment_id": "0", "run_name": "hung",
                             "user_id": "u", "status": "RUNNING", "start_time": 1, "artifact_uri": "file:///nowhere",
                             "lifecycle_stage": "active"},
                    "data": {"metrics": [], "params": [], "tags": []},
                }  # fmt: skip
                answer = json.dumps({"run": run} if "/runs/create" in self.path or "/runs/get" in self.path else {})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

            def do_GET(self):
                self._answer(b"")

            def do_POST(self):
                self._answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def release(self):
        self._released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def hanging_tracker(monkeypatch):
    """A hanging tracking server as MLflow's tracking URI; released (and MLflow's URI restored) at the end."""
    before = mlflow.get_tracking_uri()
    servers = []

    def start(answer_opening: bool = True) -> _HangingTracker:
        server = _HangingTracker(answer_opening)
        servers.append(server)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        mlflow.set_tracking_uri(server.url)
        return server

    yield start
    for server in servers:
        server.release()
    _join_tracker_threads(30)  # a tracker still waiting on the server ends once its calls fail
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


def _join_tracker_threads(timeout: float) -> None:
    import threading
    import time

    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t.name.startswith("hvd_spark-mlflow"):
            t.join(max(0.0, deadline - time.monotonic()))


def test_a_tracking_server_that_never_answers_leaves_the_fit_untracked_within_the_timeout(
    hanging_tracker, monkeypatch, caplog
):
    """Opening the run waits HVD_SPARK_MLFLOW_TIMEOUT at most (MLflow's own HTTP timeout is far
    longer), then the fit goes on untracked with a warning; the caller's active run is untouched."""
    import logging
    import time

    hanging_tracker(answer_opening=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # released at the end: fail at once
    monkeypatch.setenv("HVD_SPARK_MLFLOW_TIMEOUT", "1")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        assert _open("on") is None
    assert time.monotonic() - t0 < 5
    assert mlflow.active_run() is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name.endswith("tracking")]
    assert "did not answer within 1s (HVD_SPARK_MLFLOW_TIMEOUT)" in warning and "not tracked" in warning


@pytest.mark.timeout(400)
def test_a_tracking_server_that_hangs_mid_fit_does_not_stop_the_fit(
    spark, tmp_path, hanging_tracker, monkeypatch, caplog
):
    """The server answers the fit's opening, then hangs from the first epoch's metrics on (each call
    would wait MLflow's HTTP timeout, 60 s here). Were the epoch's metrics logged on the thread that
    reads rank 0's messages, rank 0's progress would stop reaching the driver and the stall watchdog
    (stall_timeout=5; one rank) would stop the fit. The fit returns its model with the whole history,
    HVD_SPARK_MLFLOW_TIMEOUT (5 s) after its end at most, with a warning naming what was not logged."""
    import logging
    import os
    import sys
    import time

    import keras

    import hvd_spark

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from digits import digits_frames, digits_model

    server = hanging_tracker(answer_opening=True)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")  # a hung call: longer than the stall timeout
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # released at the end: fail at once
    monkeypatch.setenv("HVD_SPARK_MLFLOW_TIMEOUT", "5")
    train, _ = digits_frames(spark)
    keras.utils.set_random_seed(1)
    epochs = 16
    est = hvd_spark.HorovodEstimator(
        num_proc=1, store=str(tmp_path / "store"), model=digits_model(), optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=8, epochs=epochs, validation=0.2, stall_timeout=5, max_restarts=0,
        mlflow="on",
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="hvd_spark")
    t0 = time.monotonic()
    model = est.fit(train)
    seconds = time.monotonic() - t0
    assert server.hanging and server.held >= 1  # the server did hang while the fit trained
    assert all(len(v) == epochs for v in model.getHistory().values()), model.getHistory()
    warnings = [r.getMessage() for r in caplog.records if r.name.endswith("tracking") and r.levelno >= logging.WARNING]
    assert any("HVD_SPARK_MLFLOW_TIMEOUT" in w and "not logged: the metrics of epoch(s) 1-" in w for w in warnings), (
        warnings
    )
    summary = model.getFitSummary()
    print(f"fit with a hung tracking server: {seconds:.1f}s (training job {summary.train_job_seconds:.1f}s)")
