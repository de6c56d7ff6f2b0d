"""Spark Connect: a real local Connect server in its own process (tests/connect_server.py),
this test process only its client. Through Connect: fit of digits (held-out accuracy, per-epoch
progress on the client, resume with exact epochs), fit's bad input before any work, hvd_spark.run
with and without a live channel, a rank's error (the other rank aborted) and a timeout; a model
fitted on the classic session gives the same predictions through Connect (both UDF kinds,
streaming); save and load of the transformer and the estimator.

These tests run last (tests/conftest.py): a Connect client switches pyspark into Connect mode for
the whole process."""

import os
import sys

import cloudpickle
import numpy as np
import pytest

pytestmark = pytest.mark.connect
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks' functions travel by value

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
from _helpers import UDF_KINDS  # noqa: E402


def _probs(df):
    return np.stack(df.sort_values("row")["label__output"].to_numpy())


@pytest.fixture(scope="module")
def classic(spark, tmp_path_factory):
    """A transformer fitted on the classic session, with its predictions there (before Connect mode)."""
    import keras
    from digits import digits_frames, digits_model
    from pyspark.sql import functions as F

    import hvd_spark

    train, test = digits_frames(spark)
    test = test.withColumn("row", F.monotonically_increasing_id())
    keras.utils.set_random_seed(1)
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path_factory.mktemp("store")), model=digits_model(),
        optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=3, verbose=0,
    )  # fmt: skip
    model = est.fit(train)
    rows = test.toPandas()
    expected = model.transform(test).toPandas()
    return est, model, rows, _probs(expected)


@pytest.fixture(scope="module")
def connect(classic, tmp_path_factory):
    pytest.importorskip("grpc", reason="Spark Connect's client needs pyspark[connect]")
    from connect_server import connect_server
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    with connect_server("local[2]", local_dir=str(tmp_path_factory.mktemp("connect-local"))) as url:
        # The Connect builder itself: pyspark's generic builder refuses a remote session while this
        # process also holds the classic one (SESSION_ALREADY_EXIST), which a Connect user never has.
        session = RemoteSparkSession.builder.remote(url).getOrCreate()
        yield session
        session.stop()


@pytest.fixture(autouse=True)
def connect_mode(monkeypatch):
    """What pyspark sets when a process makes a Connect session: pyspark.ml's functions and
    SparkSession.active() then dispatch to Connect. Only for these tests."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")


def _test_frame(connect, rows):
    return connect.createDataFrame(rows[["features", "label", "row"]])


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_transform_through_connect_equals_classic(connect, classic, udf):
    from hvd_spark._internal.common.sessions import is_connect

    _, model, rows, expected = classic
    df = _test_frame(connect, rows)
    assert is_connect(df.sparkSession)
    out = model.copy({model.inference_udf: udf}).transform(df).toPandas()
    np.testing.assert_allclose(_probs(out), expected, atol=1e-6)
    assert float((out["prediction"] == out["label"]).mean()) >= 0.9  # Spark ML's columns too


def test_streaming_transform_through_connect(connect, classic, tmp_path):
    _, model, rows, expected = classic
    src = str(tmp_path / "in")
    _test_frame(connect, rows).write.parquet(src)
    stream = connect.readStream.schema(connect.read.parquet(src).schema).parquet(src)
    query = model.transform(stream).writeStream.format("memory").queryName("connect_scored")
    query = query.trigger(availableNow=True).start()
    assert query.awaitTermination(240)
    streamed = connect.sql("select * from connect_scored").toPandas()
    np.testing.assert_allclose(_probs(streamed), expected, atol=1e-6)


def test_transformer_and_estimator_save_and_load_through_connect(connect, classic, tmp_path):
    from hvd_spark import HorovodEstimator, TFTransformer

    est, model, rows, expected = classic
    path = str(tmp_path / "transformer")
    model.save(path)
    with pytest.raises(Exception, match="already exists"):
        model.save(path)  # no silent overwrite
    model.write().overwrite().save(path)
    loaded = TFTransformer.load(path)
    np.testing.assert_allclose(_probs(loaded.transform(_test_frame(connect, rows)).toPandas()), expected, atol=1e-6)
    est.save(str(tmp_path / "estimator"))
    again = HorovodEstimator.load(str(tmp_path / "estimator"))
    assert again.getEpochs() == 3 and again.getFeatureCols() == ["features"]
    assert again.getModel().count_params() == est.getModel().count_params()


def test_bad_input_through_connect_names_the_column(connect, classic):
    _, model, rows, _ = classic
    nulls = connect.createDataFrame([([0.5] * 64, 0), (None, 1)], "features array<double>, label long")
    with pytest.raises(Exception, match=r"Feature column 'features' has 1 null values"):
        model.transform(nulls.coalesce(1)).collect()
    assert [r["label"] for r in model.copy({model.handleInvalid: "skip"}).transform(nulls).collect()] == [0]
    scalar = connect.createDataFrame([(0.5, 0)], "features double, label long")
    with pytest.raises(ValueError, match=r"Feature column 'features' holds one value per row"):
        model.transform(scalar)


def _estimator(est, store, **params):
    return est.copy({getattr(est, k): v for k, v in dict(store=str(store), **params).items()})


def test_fit_through_connect_trains_resumes_and_predicts(connect, classic, tmp_path, caplog):
    """fit on a Connect DataFrame: the ranks are coordinated inside the barrier stage, each epoch
    reaches the client through the store while the job runs, the model predicts held-out digits,
    and a second fit of the same run resumes from its checkpoint with the epochs counted exactly."""
    import logging

    from digits import digits_frames

    est, _, rows, _ = classic
    train, _ = digits_frames(connect)
    store = tmp_path / "store"
    est = _estimator(est, store, run_id="conn", epochs=4, verbose=1)
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = est.fit(train)
    text = caplog.text
    for epoch in range(1, 5):
        assert f"epoch {epoch}/4" in text
    assert len(model.getHistory()["loss"]) == 4
    out = model.transform(_test_frame(connect, rows)).toPandas()
    assert float((out["prediction"] == out["label"]).mean()) >= 0.9
    assert not (store / "runs" / "conn" / "_live").exists()  # the progress channel is removed

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        again = est.copy({est.epochs: 6}).fit(train)
    assert "resuming run 'conn' from epoch 4 of 6" in caplog.text
    assert "epoch 1/6" not in caplog.text and "epoch 6/6" in caplog.text  # only the new epochs ran
    assert len(again.getHistory()["loss"]) == 6


def test_fit_bad_input_through_connect_writes_nothing(connect, classic, tmp_path):
    est, _, rows, _ = classic
    store = tmp_path / "store"
    with pytest.raises(ValueError, match=r"feature column 'nope' is not in the DataFrame"):
        _estimator(est, store, feature_cols=["nope"]).fit(_test_frame(connect, rows))
    with pytest.raises(ValueError, match=r"num_proc must be at most the number of task slots \(2\)"):
        _estimator(est, store, num_proc=3).fit(_test_frame(connect, rows))
    assert not store.exists()  # nothing written


def _allreduce(x):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()} says hello", flush=True)
    return hvd.allreduce(tf.constant([hvd.rank() + x]), op=hvd.Sum).numpy().tolist()


def _fails_on_rank_1(marker):
    import time

    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("no such shard on rank 1")
    time.sleep(120)  # rank 0 waits: the coordinator must abort it
    open(marker, "w").close()


@pytest.mark.parametrize(
    "live, backend",
    [(False, "gloo"), (True, "gloo"), (False, "mpi")],
    ids=["output-at-end", "live-output-through-store", "mpi"],
)
def test_run_through_connect(connect, tmp_path, caplog, live, backend):
    import logging

    import hvd_spark

    store = str(tmp_path / "s") if live else None
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        out = hvd_spark.run(_allreduce, args=(1.0,), spark=connect, store=store, backend=backend)
    assert out == [[3.0], [3.0]]  # num_proc defaults to the slots of local[2]
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 says hello" in caplog.text
    if live:
        assert (tmp_path / "s").exists() and not (tmp_path / "s" / "jobs").exists()


def test_rank_error_and_timeout_through_connect(connect, tmp_path):
    import time

    import hvd_spark
    from hvd_spark.errors import JobTimeoutError, RankFailedError

    marker = tmp_path / "rank0-finished"
    with pytest.raises(RankFailedError) as err:
        hvd_spark.run(_fails_on_rank_1, args=(str(marker),), num_proc=2, spark=connect)
    assert err.value.rank == 1 and "KeyError" in str(err.value) and "no such shard on rank 1" in str(err.value)
    assert "_fails_on_rank_1" in str(err.value)  # the remote traceback
    assert isinstance(err.value.__cause__, KeyError)
    assert not marker.exists()  # rank 0 was stopped, not waited for

    with pytest.raises(JobTimeoutError, match=r"did not finish within timeout=8s; ranks \[0, 1\]") as err:
        hvd_spark.run(time.sleep, args=(300,), num_proc=2, spark=connect, timeout=8)
    assert "Where each unfinished rank was" in str(err.value)

    # The stall watchdog, run by the coordinator in the first barrier task.
    from hvd_spark.errors import RankStalledError

    with pytest.raises(RankStalledError) as err:
        hvd_spark.run(_stalls_on_rank_1, num_proc=2, spark=connect, stall_timeout=6, timeout=300)
    assert err.value.ranks[0] == 1 and "Most likely stalled: rank(s) [1]" in str(err.value)
    assert "last at iteration 3" in str(err.value)


def _stalls_on_rank_1():
    """Rank 1 stops joining the allreduces after 3 (it sleeps): a stall, seen through mark_progress."""
    import time

    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_spark

    hvd.init()
    for i in range(100000):
        hvd_spark.mark_progress(f"iteration {i}")
        if hvd.rank() == 1 and i == 3:
            time.sleep(3600)
        hvd.allreduce(tf.constant(1.0))


class _KillRank1Once:
    """A Keras callback (built lazily: keras is imported by the ranks) that SIGKILLs rank 1 at the end
    of epoch 2, the first time only."""

    def __new__(cls, marker):
        import keras

        class KillRank1Once(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                import signal

                if epoch == 1 and os.environ.get("HVD_SPARK_RANK") == "1" and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)

        return KillRank1Once()


def test_killed_rank_restarts_from_checkpoint_through_connect(connect, classic, tmp_path):
    from digits import digits_frames

    est, _, _, _ = classic
    train, _ = digits_frames(connect)
    store = tmp_path / "store"
    marker = str(tmp_path / "killed")
    est = _estimator(est, store, run_id="crashy", epochs=4, max_restarts=1, callbacks=[_KillRank1Once(marker)])
    model = est.fit(train)
    assert os.path.exists(marker)  # the kill happened
    assert model.getFitSummary().restarts == 1
    assert len(model.getHistory()["loss"]) == 4  # every epoch exactly once
    assert sorted(p.name for p in (store / "runs" / "crashy" / "checkpoints").glob("epoch-????.json")) == [
        f"epoch-{e:04d}.json" for e in (1, 2, 3, 4)
    ]


def test_torch_fit_through_connect_trains_resumes_and_predicts(connect, classic, tmp_path, caplog):
    """A TorchEstimator fit on a Connect DataFrame: epochs reach the client while the job runs, the model
    predicts held-out digits through Connect, and a second fit of the run trains only the new epoch."""
    import logging

    torch = pytest.importorskip("torch")
    from digits import digits_frames
    from torch_digits import digits_net

    from hvd_spark.torch import TorchEstimator, TorchModel

    _, _, rows, _ = classic
    train, _ = digits_frames(connect)
    torch.manual_seed(1)
    net = digits_net()
    est = TorchEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.003),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], batch_size=32,
        epochs=5, run_id="tconn", verbose=1,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = est.fit(train)
    assert all(f"epoch {e}/5" in caplog.text for e in range(1, 6))
    out = model.transform(_test_frame(connect, rows)).toPandas()
    assert float((out["prediction"] == out["label"]).mean()) >= 0.9
    model.write().save(str(tmp_path / "saved"))
    again = TorchModel.load(str(tmp_path / "saved")).transform(_test_frame(connect, rows)).toPandas()
    np.testing.assert_array_equal(again["prediction"], out["prediction"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        resumed = est.copy({est.epochs: 6}).fit(train)
    assert "resuming run 'tconn' from epoch 5 of 6" in caplog.text and "epoch 1/6" not in caplog.text
    assert len(resumed.getHistory()["loss"]) == 6
