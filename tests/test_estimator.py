"""HorovodEstimator / TFTransformer end to end: real Spark, 2 Horovod ranks over Gloo, real Parquet and checkpoints."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import hvd_spark
from hvd_spark import HorovodEstimator, Store, TFTransformer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _helpers import READERS, UDF_KINDS, small_model, xor_estimator, xor_frame  # noqa: E402
from digits import digits_frames, digits_model  # noqa: E402


@pytest.fixture(scope="module")
def digits(spark):
    train, test = digits_frames(spark)
    return train.cache(), test.cache()


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    """One real 2-rank training on digits, shared by the tests that only read its result."""
    store = str(tmp_path_factory.mktemp("store"))
    keras.utils.set_random_seed(1)  # the model's initial weights
    est = HorovodEstimator(
        num_proc=2,
        store=store,
        model=digits_model(),
        optimizer=keras.optimizers.Adam(learning_rate=0.002),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        validation=0.1,
        batch_size=32,
        epochs=10,
        random_seed=1,
        run_id="digits",
    )
    model = est.fit(digits[0])
    return est, model, store


def _probs(df, col="label__output"):
    return np.stack(df.select(col).toPandas()[col].to_numpy())


def test_digits_accuracy_history_and_identical_weights(fitted, digits):
    est, model, store = fitted
    scored = model.transform(digits[1]).select("label", "label__output").toPandas()
    probs = np.stack(scored["label__output"].to_numpy())
    assert probs.shape == (len(scored), 10)
    accuracy = (probs.argmax(1) == scored["label"].to_numpy()).mean()
    assert accuracy >= 0.95, f"held-out accuracy {accuracy:.3f}"
    history = model.getHistory()
    assert len(history["loss"]) == 10 and len(history["val_accuracy"]) == 10
    assert history["loss"][-1] < history["loss"][0]
    # Both ranks trained on different files and ended with bit-identical weights.
    ranks = model.getFitSummary().ranks
    assert len({r.weights_digest for r in ranks}) == 1
    assert [r.rank for r in ranks] == [0, 1]
    # Input columns are kept; the output column is array<double>; a classifier (sparse categorical
    # cross-entropy) also gets Spark ML's columns, which Spark's evaluators read.
    out = model.transform(digits[1])
    assert out.columns == ["features", "label", "label__output", "prediction", "probability", "rawPrediction"]
    assert out.schema["label__output"].dataType.simpleString() == "array<double>"
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) == pytest.approx(accuracy)
    # Ten checkpoints, each complete, and TensorBoard logs, in the run directory.
    s = Store(store)
    assert [c.epoch for c in s.checkpoints("digits")] == list(range(1, 11))
    assert s.files.exists(s.model_path("digits")) and s.files.listdir(s.logs_path("digits"))


def test_transform_matches_keras_predict(fitted, digits):
    _, model, _ = fitted
    rows = digits[1].toPandas()
    x = np.stack(rows["features"].to_numpy()).reshape(-1, 8, 8, 1)
    expected = model.getModel().predict(x, verbose=0)
    got = _probs(model.transform(digits[1]))
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_transform_udf_kinds_agree_with_keras(fitted, digits, udf):
    _, model, _ = fitted
    rows = digits[1].toPandas()
    x = np.stack(rows["features"].to_numpy()).reshape(-1, 8, 8, 1)
    expected = model.getModel().predict(x, verbose=0)
    chosen = model.copy({model.inference_udf: udf, model.batch_size: 50})  # several model calls per Arrow batch
    np.testing.assert_allclose(_probs(chosen.transform(digits[1])), expected, atol=1e-5)


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_transform_of_bad_rows_names_the_column(fitted, spark, udf):
    """A row of the wrong length (which a flat reshape could silently mix with its neighbours), a null,
    and a scalar column for an array input: errors that name the column and the input."""
    _, model, _ = fitted
    model = model.copy({model.inference_udf: udf})
    rows = [([0.5] * 64, 0), ([0.5] * 60, 1), ([0.5] * 68, 2)]  # 192 values in 3 rows: reshapes, wrongly
    bad_length = spark.createDataFrame(rows, "features array<double>, label long").coalesce(1)
    with pytest.raises(Exception, match=r"Feature column 'features' does not fit model input .* 64 values per row"):
        model.transform(bad_length).collect()
    nulls = spark.createDataFrame([([0.5] * 64, 0), (None, 1)], "features array<double>, label long").coalesce(1)
    with pytest.raises(Exception, match=r"Feature column 'features' has 1 null values"):
        model.transform(nulls).collect()
    # Asked for: a null prediction for that row (the other predicted as alone), or the row left out.
    kept = model.copy({model.handleInvalid: "keep"}).transform(nulls).orderBy("label").collect()
    alone = model.transform(nulls.where("label = 0")).collect()[0]
    assert kept[0]["label__output"] == pytest.approx(alone["label__output"]) and kept[0]["prediction"] is not None
    assert (kept[1]["label__output"], kept[1]["prediction"], kept[1]["probability"]) == (None, None, None)
    assert [r["label"] for r in model.copy({model.handleInvalid: "skip"}).transform(nulls).collect()] == [0]
    with pytest.raises(ValueError, match="handleInvalid must be 'error', 'keep' or 'skip'"):
        model.copy({model.handleInvalid: "drop"}).transform(nulls)
    scalar = spark.createDataFrame([(0.5, 0)], "features double, label long")
    with pytest.raises(ValueError, match=r"Feature column 'features' holds one value per row; model input"):
        model.transform(scalar)  # found on the schema, before any job


def test_transformer_save_load_and_exports(fitted, digits, tmp_path):
    _, model, _ = fitted
    before = _probs(model.transform(digits[1]))
    model.save(str(tmp_path / "tf_transformer"))
    loaded = TFTransformer.load(str(tmp_path / "tf_transformer"))
    np.testing.assert_array_equal(_probs(loaded.transform(digits[1])), before)
    assert loaded.getHistory() == model.getHistory()
    assert loaded.getFeatureCols() == ["features"] and loaded.getOutputCols() == ["label__output"]

    x = np.stack(digits[1].limit(16).toPandas()["features"].to_numpy()).reshape(-1, 8, 8, 1).astype("float32")
    keras_path = model.save_keras(str(tmp_path / "m.keras"))
    np.testing.assert_allclose(keras.models.load_model(keras_path).predict(x, verbose=0), before[:16], atol=1e-5)
    import tensorflow as tf

    saved = tf.saved_model.load(model.export_saved_model(str(tmp_path / "saved_model")))
    np.testing.assert_allclose(saved.serve(tf.constant(x)).numpy(), before[:16], atol=1e-5)


def test_checkpoint_loads_in_fresh_process_and_continues_training(fitted, tmp_path):
    """A checkpoint written with the distributed optimizer loads anywhere, step counter intact."""
    _, _, store = fitted
    s = Store(store)
    ckpt = s.latest_checkpoint("digits").model_path
    script = textwrap.dedent(f"""
        import keras, numpy as np
        m = keras.models.load_model({ckpt!r})
        before = int(m.optimizer.iterations.numpy())
        m.fit(np.zeros((8, 8, 8, 1), "float32"), np.zeros(8, "int64"), batch_size=8, epochs=1, verbose=0)
        print("ITER", type(m.optimizer).__name__, before, int(m.optimizer.iterations.numpy()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ITER")]
    assert line, out.stderr[-3000:]
    _, cls, before, after = line[0].split()
    assert cls == "Adam" and int(before) > 0 and int(after) == int(before) + 1


def test_streaming_transform(fitted, digits, spark, tmp_path):
    _, model, _ = fitted
    src = str(tmp_path / "stream_in")
    digits[1].write.parquet(src)
    stream = spark.readStream.schema(digits[1].schema).parquet(src)
    query = (
        model.transform(stream)
        .writeStream.format("memory")
        .queryName("digits_scored")
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(240)
    streamed = spark.sql("select * from digits_scored").toPandas().sort_values("label", kind="stable")
    batch = model.transform(spark.read.parquet(src)).toPandas().sort_values("label", kind="stable")
    assert len(streamed) == len(batch) == digits[1].count()
    key = lambda df: sorted(tuple(np.round(p, 5)) for p in df["label__output"])  # noqa: E731
    assert key(streamed) == key(batch)


def test_resume_counts_epochs_exactly(spark, tmp_path):
    df = xor_frame(spark, 256)
    store = str(tmp_path / "store")
    model = small_model()
    kw = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
        run_id="resume-me",
        validation=0.25,
    )
    first = HorovodEstimator(epochs=2, **kw)
    m2 = first.fit(df)
    steps = m2.getFitSummary().steps_per_epoch
    assert len(m2.getHistory()["loss"]) == 2
    assert m2.getFitSummary().ranks[0].iterations == 2 * steps

    second = HorovodEstimator(epochs=5, **kw)
    m5 = second.fit(df)
    history = m5.getHistory()
    assert len(history["loss"]) == 5 and len(history["val_loss"]) == 5
    assert history["loss"][:2] == m2.getHistory()["loss"]  # the first two epochs are kept, not redone
    assert m5.getFitSummary().ranks[0].iterations == 5 * steps  # optimizer step counter continued
    assert [c.epoch for c in Store(store).checkpoints("resume-me")] == [1, 2, 3, 4, 5]
    lr = float(m5.getModel().optimizer.learning_rate.numpy())
    assert abs(lr - 0.05) < 1e-7  # never scaled, let alone twice

    # A finished run returns its model without training again.
    third = HorovodEstimator(epochs=5, **kw)
    m5b = third.fit(df)
    assert m5b.getFitSummary() is None and m5b.getHistory() == history

    # A different model in the same run_id is refused before any work.
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1, activation="sigmoid")])
    differs = "run_id 'resume-me' .* was trained with another model.*model_class: 'Functional' -> 'Sequential'"
    with pytest.raises(ValueError, match=differs):
        HorovodEstimator(epochs=6, **dict(kw, model=other)).fit(df)

    # Other rows, or another split of them, are refused before any work, finished or resumed (before: the
    # run went on, or returned its model, on whatever data it was given).
    other_rows = xor_frame(spark, 256, seed=1)
    for epochs in (6, 5):
        with pytest.raises(
            ValueError,
            match="run_id 'resume-me' .* was trained on other data.*differs .*: the DataFrame's query or the rows",
        ):
            HorovodEstimator(epochs=epochs, **kw).fit(other_rows)
    with pytest.raises(ValueError, match=r"validation: 0.25 -> 0.3"):
        HorovodEstimator(epochs=6, **dict(kw, validation=0.3)).fit(df)
    assert [c.epoch for c in Store(store).checkpoints("resume-me")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("reader", READERS)
def test_both_readers_train_to_identical_weights_across_ranks(spark, tmp_path, reader):
    df = xor_frame(spark, 512, seed=4)
    keras.utils.set_random_seed(4)
    est = xor_estimator(
        tmp_path, optimizer=keras.optimizers.Adam(0.05), metrics=["accuracy"], batch_size=32, epochs=8, reader=reader
    )
    model = est.fit(df)
    assert len({r.weights_digest for r in model.getFitSummary().ranks}) == 1
    assert model.getHistory()["accuracy"][-1] >= 0.85, model.getHistory()["accuracy"]


@pytest.mark.parametrize("rows,partitions", [(7, 1), (7, 2), (1, 1)])
def test_uneven_and_tiny_data_finish(spark, tmp_path, rows, partitions):
    df = xor_frame(spark, rows, partitions=partitions, seed=rows)
    est = xor_estimator(tmp_path, batch_size=4)
    model = est.fit(df)
    assert len(model.getHistory()["loss"]) == 2
    assert len({r.weights_digest for r in model.getFitSummary().ranks}) == 1
    out = model.transform(df).toPandas()
    assert len(out) == rows and out["y__output"].between(0, 1).all()


def test_multi_input_multi_output_with_sample_weights(spark, tmp_path):
    df = xor_frame(spark, 128)
    a = keras.Input(shape=(2,), name="a")
    b = keras.Input(shape=(1,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    cls = keras.layers.Dense(1, activation="sigmoid", name="cls")(h)
    reg = keras.layers.Dense(2, name="reg")(h)
    model = keras.Model([a, b], [cls, reg])
    est = HorovodEstimator(
        num_proc=2,
        store=str(tmp_path),
        model=model,
        optimizer="adam",
        loss=["binary_crossentropy", "mse"],
        loss_weights=[1.0, 0.5],
        feature_cols=["x", "x0"],
        label_cols=["y", "x"],
        sample_weight_col="w",
        output_cols=["p_cls", "p_reg"],
        batch_size=16,
        epochs=2,
    )
    fitted = est.fit(df)
    out = fitted.transform(df)
    assert out.schema["p_cls"].dataType.simpleString() == "double"
    assert out.schema["p_reg"].dataType.simpleString() == "array<double>"
    pdf = out.toPandas()
    assert pdf["p_reg"].map(len).eq(2).all() and pdf["p_cls"].between(0, 1).all()
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1


def test_pipeline_with_vector_assembler_save_load(spark, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    df = xor_frame(spark, 128).selectExpr("x[0] as a", "x[1] as b", "y")
    est = xor_estimator(tmp_path / "store", optimizer=keras.optimizers.Adam(0.01), feature_cols=["features"])
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b"], outputCol="features"), est])
    fitted = pipeline.fit(df)
    before = fitted.transform(df).select("y__output").toPandas()["y__output"].to_numpy()
    fitted.save(str(tmp_path / "pipeline_model"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline_model"))
    after = loaded.transform(df).select("y__output").toPandas()["y__output"].to_numpy()
    np.testing.assert_array_equal(before, after)

    # The estimator saves, loads, and the loaded one fits again.
    est.save(str(tmp_path / "estimator"))
    est2 = HorovodEstimator.load(str(tmp_path / "estimator"))
    assert est2.getOrDefault("epochs") == 2 and est2.getOrDefault("feature_cols") == ["features"]
    assert isinstance(est2.getOrDefault("store"), Store)
    refit = Pipeline(stages=[VectorAssembler(inputCols=["a", "b"], outputCol="features"), est2]).fit(df)
    assert len(refit.stages[-1].getHistory()["loss"]) == 2


def averaging_job(distributed):
    """Two ranks, different data and different initial weights; rank 0's weights are broadcast."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    from hvd_spark.keras import BroadcastStateCallback, make_distributed

    hvd.init()
    keras.utils.set_random_seed(100 + hvd.rank())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    if distributed:
        make_distributed(opt)
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(64, 4)), rng.normal(size=(64, 1))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[BroadcastStateCallback()], shuffle=False)
    return [w.tolist() for w in model.get_weights()]


@pytest.mark.parametrize("distributed", [True, False])
def test_gradient_averaging_is_what_keeps_ranks_identical(spark, distributed):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    w0, w1 = hvd_spark.run(averaging_job, args=(distributed,), num_proc=2, spark=spark, verbose=0)
    same = all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(w0, w1))
    assert same is distributed


class KillRankOnce(keras.callbacks.Callback):
    """Kills rank 1's process (SIGKILL) at the end of epoch 2, the first time only."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_epoch_end(self, epoch, logs=None):
        import signal

        if epoch == 1 and os.environ.get("HVD_SPARK_RANK") == "1" and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def test_killed_worker_then_training_finishes(spark, tmp_path):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    est = xor_estimator(
        store, epochs=4, run_id="crashy", callbacks=[KillRankOnce(str(tmp_path / "killed"))], max_restarts=1
    )
    model = est.fit(df)
    assert os.path.exists(tmp_path / "killed")  # the kill happened
    summary = model.getFitSummary()
    assert summary.restarts == 1
    assert len(model.getHistory()["loss"]) == 4  # every epoch exactly once
    assert [c.epoch for c in Store(store).checkpoints("crashy")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch

    # Without restarts, the same kill fails the fit and names the rank.
    os.remove(tmp_path / "killed")
    from hvd_spark import RankFailedError

    with pytest.raises(
        RankFailedError, match="rank 1 on host 127.0.0.1 failed with ProcessDied: process killed by signal 9"
    ):
        xor_estimator(store, epochs=4, run_id="crashy-2", callbacks=[KillRankOnce(str(tmp_path / "killed"))]).fit(df)


def accumulation_job():
    """Gradient accumulation against the large batch it stands for, on two ranks with different data."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    from hvd_spark.keras import make_distributed

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")

    def trained(batch_size, passes, rows):
        keras.utils.set_random_seed(3)  # the same initial weights everywhere
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        initial = [w.tolist() for w in model.get_weights()]
        opt = make_distributed(keras.optimizers.SGD(0.1), backward_passes_per_step=passes)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x[:rows], y[:rows], batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        return initial, [w.tolist() for w in model.get_weights()], int(opt.iterations.numpy())

    return {
        "big": trained(16, 1, 16),  # one update from 16 rows per rank
        "accumulated": trained(8, 2, 16),  # two batches of 8, one update
        "pending": trained(8, 2, 8),  # one batch of 8 of the 2 an update needs
    }


def test_backward_passes_per_step_is_the_larger_batch_it_stands_for(spark):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    r0, r1 = hvd_spark.run(accumulation_job, num_proc=2, spark=spark, verbose=0)
    initial, big, big_steps = r0["big"]
    _, acc, acc_steps = r0["accumulated"]
    _, pending, pending_steps = r0["pending"]
    assert big_steps == acc_steps == 1 and pending_steps == 0
    assert not np.allclose(np.concatenate([np.ravel(w) for w in big]), np.concatenate([np.ravel(w) for w in initial]))
    for a, b in zip(acc, big):  # averaged over 2 batches and 2 ranks = averaged over the 4 batches at once
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert pending == initial  # a batch that only accumulates changes no weight
    assert r1["accumulated"][1] == acc  # and the ranks agree exactly


def test_estimator_backward_passes_per_step_and_compression(spark, tmp_path):
    df = xor_frame(spark, 256)
    est = xor_estimator(tmp_path / "store", backward_passes_per_step=2, gradient_compression="fp16", epochs=2)
    model = est.fit(df)
    summary = model.getFitSummary()
    steps = summary.steps_per_epoch
    assert [r.iterations for r in summary.ranks] == [2 * steps // 2] * 2  # one update per 2 batches
    assert len({r.weights_digest for r in summary.ranks}) == 1
    for bad, match in (
        (dict(backward_passes_per_step=0), "backward_passes_per_step must be at least 1"),
        (dict(gradient_compression="int8"), "gradient_compression must be 'none' or 'fp16'"),
    ):
        with pytest.raises(ValueError, match=match):
            xor_estimator(tmp_path / "store2", **bad).fit(df)
    assert not os.path.exists(tmp_path / "store2" / "runs")


class _EnvProbe(keras.callbacks.Callback):
    """Writes what a rank sees of two environment variables into a folder of the test."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_train_begin(self, logs=None):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        inter = tf.config.threading.get_inter_op_parallelism_threads()  # what TensorFlow was given
        with open(os.path.join(self.folder, f"rank-{hvd.rank()}"), "w") as f:
            f.write(f"{os.environ.get('HVD_SPARK_TEST_ENV')},{os.environ.get('TF_NUM_INTEROP_THREADS')},{inter}")


def test_backend_env_reaches_every_rank_and_its_credentials_are_not_saved(spark, tmp_path, caplog):
    """horovod.spark's backend_env: the ranks' environment, winning over hvd_spark's defaults; saving the
    estimator keeps the plain variables and leaves the credentials out."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    probe = tmp_path / "seen"
    probe.mkdir()
    env = {"HVD_SPARK_TEST_ENV": "from-the-user", "TF_NUM_INTEROP_THREADS": "3", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    est = xor_estimator(
        tmp_path / "store", model=small_model(), epochs=1, backend_env=env, callbacks=[_EnvProbe(str(probe))]
    )
    est.fit(xor_frame(spark, 64))
    # TF_NUM_INTEROP_THREADS=3 reaches TensorFlow itself, not only the environment (num_threads is 1)
    assert sorted(p.read_text() for p in probe.iterdir()) == ["from-the-user,3,3", "from-the-user,3,3"]
    est.save(str(tmp_path / "saved"))
    saved = [p.read_bytes() for p in (tmp_path / "saved").rglob("*") if p.is_file()]
    assert saved and not any(b"s3cr3t" in data or b"AWS_SECRET_ACCESS_KEY" in data for data in saved)
    loaded = HorovodEstimator.load(str(tmp_path / "saved"))
    assert loaded.getBackendEnv() == {"HVD_SPARK_TEST_ENV": "from-the-user", "TF_NUM_INTEROP_THREADS": "3"}
