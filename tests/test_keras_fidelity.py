"""The differential suite: Keras' own ``fit`` / ``evaluate`` is the reference.

Each case runs one model with one set of ``compile`` / ``fit`` options three ways on the same rows:
plain Keras in this process, hvd_spark with 1 rank and hvd_spark with 2 ranks (real Spark ``local[2]``,
real Horovod over Gloo). The data is one Parquet file of one row group, read in place with a validation
column and ``shuffle=False``, so a single rank reads the training rows in the order plain Keras gets them.

What must hold:
- 1 rank: the same per-epoch history (every metric, ``val_*`` included) and the same final weights as
  plain Keras (tolerance 1e-5: the same float32 operations in the same order; the reader's cast and
  batching are exact).
- 2 ranks: every ``val_*`` equals Keras' ``evaluate`` of the returned model on the validation rows
  (1e-5; the validation rows split into full batches on each rank, since Keras averages per-output
  losses per batch); the compile options the ranks trained with are the user's; weights agree on all
  ranks (``fit`` compares their digests).
"""

import json
import os
import sys

import cloudpickle
import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _helpers import fit_in_place

from hvd_spark import RankFailedError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the callbacks and model classes travel by value

ROWS, VAL_ROWS, BATCH = 192, 64, 16  # 2 ranks: 32 validation rows each, two full batches
RTOL, ATOL = 1e-5, 1e-6


def _data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = ROWS + VAL_ROWS
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8,)).astype("float32")
    score = x @ w
    return {
        "x": x,
        "price": (score + 0.1 * rng.normal(size=n)).astype("float32"),
        "count": (np.abs(score) + 0.1 * rng.normal(size=n)).astype("float32"),
        "cls": np.digitize(score, np.quantile(score, [0.6, 0.85])).astype("int64"),  # 3 unbalanced classes
        "bin": (score > 0.3).astype("float32"),
        "weight": rng.uniform(0.5, 2.0, size=n).astype("float32"),
        "is_val": np.arange(n) >= ROWS,
    }


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """One Parquet file, one row group: training rows first, then the validation rows."""
    data = _data()
    path = str(tmp_path_factory.mktemp("fidelity") / "table.parquet")
    columns = {k: (pa.array(list(v), type=pa.list_(pa.float32())) if v.ndim == 2 else v) for k, v in data.items()}
    pq.write_table(pa.table(columns), path, row_group_size=ROWS + VAL_ROWS)
    return path, data


def _split(data, names):
    train, val = ~data["is_val"], data["is_val"]
    return [data[n][train] for n in names], [data[n][val] for n in names]


def _plain_fit(make_model, data, features, labels, *, epochs, weight=None, **fit_kw):
    """Plain Keras: the model's own ``fit`` on the training rows, validated on the validation rows."""
    model = make_model()
    (xs, vxs), (ys, vys) = _split(data, features), _split(data, labels)
    x, vx = (xs[0], vxs[0]) if len(xs) == 1 else (xs, vxs)
    y, vy = (ys[0], vys[0]) if len(ys) == 1 else (dict(zip(labels, ys)), dict(zip(labels, vys)))
    sw = data[weight][~data["is_val"]] if weight else None
    vsw = data[weight][data["is_val"]] if weight else None
    validation = (vx, vy, vsw) if weight else (vx, vy)
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        validation_data=validation,
        validation_batch_size=BATCH,
        verbose=0,
        **fit_kw,
    )
    return model, history.history


def _evaluate(model, data, features, labels, weight=None) -> dict[str, float]:
    (_, vxs), (_, vys) = _split(data, features), _split(data, labels)
    vx = vxs[0] if len(vxs) == 1 else vxs
    vy = vys[0] if len(vys) == 1 else dict(zip(labels, vys))  # multi-output models here name outputs as labels
    vsw = data[weight][data["is_val"]] if weight else None
    return model.evaluate(vx, vy, sample_weight=vsw, batch_size=BATCH, verbose=0, return_dict=True)


def _hvd_fit(spark, store, path, make_model, features, labels, *, num_proc, epochs, **params):
    return fit_in_place(
        spark, store, path, make_model(), features, labels, num_proc=num_proc, batch=BATCH, epochs=epochs, **params
    )


def _assert_history_equal(got: dict, want: dict, what: str) -> None:
    assert set(want) <= set(got), f"{what}: Keras reports {sorted(want)}, hvd_spark {sorted(got)}"
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {key}")


def _assert_val_is_evaluate(history: dict, evaluated: dict, what: str, epoch: int = -1) -> None:
    """``val_*`` of ``epoch`` (the one whose weights the model holds) against ``evaluate``."""
    for key, value in evaluated.items():
        assert f"val_{key}" in history, f"{what}: no val_{key} in {sorted(history)}"
        got = history[f"val_{key}"][epoch]
        np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {key}")


def _differential(
    spark,
    tmp_path,
    table,
    make_model,
    features,
    labels,
    *,
    epochs=2,
    weight=None,
    fit_kw=None,
    make_callbacks=None,
    best=False,
    **params,
):
    """Plain Keras, 1 rank, 2 ranks; returns the 2-rank fitted model. ``fit_kw`` are keras.Model.fit's
    arguments, which are the estimator's Params of the same names; ``make_callbacks`` gives each run its
    own new callbacks (they keep state); ``best``: the model returned holds the weights of the epoch with
    the lowest val_loss (EarlyStopping's restore_best_weights), not the last epoch's."""
    path, data = table

    def with_callbacks(kw: dict) -> dict:
        return dict(kw, callbacks=make_callbacks()) if make_callbacks is not None else dict(kw)

    fit_kw = dict(fit_kw or {})
    plain, plain_history = _plain_fit(
        make_model, data, features, labels, epochs=epochs, weight=weight, **with_callbacks(fit_kw)
    )
    extra = dict(params, **fit_kw, **({"sample_weight_col": weight} if weight else {}))
    one = _hvd_fit(
        spark, tmp_path / "s1", path, make_model, features, labels, num_proc=1, epochs=epochs, **with_callbacks(extra)
    )
    _assert_history_equal(one.getHistory(), plain_history, "1 rank against plain Keras")
    for got, want in zip(one.getModel().get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    two = _hvd_fit(
        spark, tmp_path / "s2", path, make_model, features, labels, num_proc=2, epochs=epochs, **with_callbacks(extra)
    )
    history = two.getHistory()
    assert set(history) == set(plain_history), (sorted(history), sorted(plain_history))
    epoch = int(np.argmin(history["val_loss"])) if best else -1
    _assert_val_is_evaluate(history, _evaluate(two.getModel(), data, features, labels, weight), "2 ranks", epoch)
    return two


def _dense_trunk(inputs):
    return keras.layers.Dense(16, activation="tanh", name="trunk")(inputs)


def test_multi_output_per_output_losses_and_metrics(spark, tmp_path, table):
    """Issue 36.1: val_<output>_loss was about half of evaluate's (Keras counted a step more over a
    dataset of unknown length); the total val_loss was right, so the parts did not add up to it."""

    def make():
        keras.utils.set_random_seed(1)
        x = keras.Input((8,), name="x")
        h = _dense_trunk(x)
        model = keras.Model(
            x, {"price": keras.layers.Dense(1, name="price")(h), "count": keras.layers.Dense(1, name="count")(h)}
        )
        model.compile(
            keras.optimizers.Adam(0.01),
            loss={"price": "mse", "count": "mae"},
            loss_weights={"price": 1.0, "count": 0.5},
            metrics={"price": ["mae"], "count": [keras.metrics.RootMeanSquaredError(name="rmse")]},
        )
        return model

    two = _differential(spark, tmp_path, table, make, ["x"], ["price", "count"])
    h = two.getHistory()
    assert {"val_price_loss", "val_count_loss", "val_price_mae", "val_count_rmse"} <= set(h)
    total = h["val_price_loss"][-1] + 0.5 * h["val_count_loss"][-1]
    assert h["val_loss"][-1] == pytest.approx(total, rel=1e-5)  # the parts add up to the whole


def test_multi_input_with_auc_and_precision(spark, tmp_path, table):
    """Two inputs (an array column and a scalar one), metrics whose state is not a mean (AUC buckets,
    precision counts): summed over the ranks, val_* is one evaluate of the whole split."""

    def make():
        keras.utils.set_random_seed(10)
        x, w = keras.Input((8,), name="x"), keras.Input((1,), name="weight")
        h = keras.layers.Concatenate()([_dense_trunk(x), w])
        model = keras.Model([x, w], keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile(
            keras.optimizers.Adam(0.01),
            "binary_crossentropy",
            metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")],
        )
        return model

    _differential(spark, tmp_path, table, make, ["x", "weight"], ["bin"])


def test_class_weight_validation_freq_and_sequential(spark, tmp_path, table):
    """Issue 36.5: class_weight and validation_freq were refused as unknown parameters."""

    def make():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(
            keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    fit_kw = {"class_weight": {0: 0.5, 1: 1.5, 2: 3.0}, "validation_freq": 2}
    two = _differential(spark, tmp_path, table, make, ["x"], ["cls"], epochs=4, fit_kw=fit_kw)
    assert len(two.getHistory()["val_loss"]) == 2  # epochs 2 and 4 only, as Keras


def test_compile_options_and_weighted_metrics(spark, tmp_path, table):
    """Issue 36.2: the ranks recompiled with optimizer, loss, metrics and loss_weights only, dropping
    weighted_metrics, steps_per_execution, run_eagerly, jit_compile and auto_scale_loss."""
    seen = str(tmp_path / "seen")

    def make():
        keras.utils.set_random_seed(3)
        x = keras.Input((8,))
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid")(_dense_trunk(x)))
        model.compile(
            "adam",
            "binary_crossentropy",
            metrics=["accuracy"],
            weighted_metrics=[keras.metrics.BinaryAccuracy(name="wacc"), keras.metrics.AUC(name="wauc")],
            steps_per_execution=3,
        )
        return model

    _differential(spark, tmp_path, table, make, ["x"], ["bin"], weight="weight", callbacks=[_Record(seen)])
    # The same model given an optimizer Param: the user's other compile options still hold on the ranks.
    path, _ = table
    _hvd_fit(
        spark,
        tmp_path / "s3",
        path,
        make,
        ["x"],
        ["bin"],
        num_proc=2,
        epochs=1,
        optimizer=keras.optimizers.SGD(0.1),
        callbacks=[_Record(seen)],
        sample_weight_col="weight",
    )
    records = _records(seen)
    assert {r["rank"] for r in records} == {0, 1}
    for r in records:
        assert r["steps_per_execution"] == 3 and r["run_eagerly"] is False, r
        assert r["weighted_metrics"] == ["wacc", "wauc"], r
    assert {r["optimizer"] for r in records} == {"Adam", "SGD"}


class _Record(keras.callbacks.Callback):
    """Writes what the rank's model was compiled with to ``folder/<rank>-<pid>.json``."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_train_begin(self, logs=None):
        import horovod.tensorflow as hvd

        m = self.model
        opt = m.optimizer
        record = {
            "rank": hvd.rank(),
            "optimizer": type(getattr(opt, "inner_optimizer", opt)).__name__,  # the averaging keeps class names
            "loss_scale": isinstance(opt, keras.optimizers.LossScaleOptimizer),
            "steps_per_execution": m.steps_per_execution,
            "run_eagerly": m.run_eagerly,
            "jit_compile": m.jit_compile,
            "dtype_policy": m.dtype_policy.name,
            "weighted_metrics": [w["config"]["name"] for w in m.get_compile_config().get("weighted_metrics") or []],
        }
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{hvd.rank()}-{os.getpid()}.json"), "w") as f:
            json.dump(record, f)


def _records(folder) -> list[dict]:
    out = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            out.append(json.load(f))
    return out


def test_mixed_float16_trains_with_a_loss_scale_on_the_ranks(spark, tmp_path, table):
    """Issue 36.2: under the driver's mixed_float16 policy the ranks trained without the
    LossScaleOptimizer that compile adds (their global policy was float32)."""
    path, data = table
    seen = str(tmp_path / "seen")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(4)
        x = keras.Input((8,))
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid", dtype="float32")(_dense_trunk(x)))
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    fitted = _hvd_fit(
        spark, tmp_path / "s", path, lambda: model, ["x"], ["bin"], num_proc=2, epochs=1, callbacks=[_Record(seen)]
    )
    records = _records(seen)
    assert all(r["loss_scale"] and r["dtype_policy"] == "mixed_float16" for r in records), records
    _assert_val_is_evaluate(fitted.getHistory(), _evaluate(fitted.getModel(), data, ["x"], ["bin"]), "mixed_float16")


def test_bfloat16_with_early_stopping_and_reduce_lr(spark, tmp_path, table):
    """mixed_bfloat16 layers, EarlyStopping with restore_best_weights and ReduceLROnPlateau on val_loss:
    1 rank stops at the same epoch with the same history and weights as plain Keras."""

    def make():
        keras.utils.set_random_seed(6)
        x = keras.Input((8,))
        h = keras.layers.Dense(16, activation="tanh", dtype="mixed_bfloat16")(x)
        model = keras.Model(x, keras.layers.Dense(1, dtype="float32")(h))
        model.compile(keras.optimizers.SGD(0.3), "mse")  # a rate high enough to oscillate: the callbacks act
        return model

    def callbacks():
        return [
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0),
        ]

    two = _differential(spark, tmp_path, table, make, ["x"], ["price"], epochs=8, make_callbacks=callbacks, best=True)
    assert len(two.getHistory()["loss"]) < 8, two.getHistory()  # stopped early, at the same epoch as Keras


class _StopOnRank(keras.callbacks.Callback):
    """Stops training on one rank only, at a step (a rank-local condition)."""

    def __init__(self, rank: int, step: int):
        super().__init__()
        self.rank, self.step = rank, step

    def on_train_batch_end(self, batch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() == self.rank and batch + 1 == self.step:
            self.model.stop_training = True


def _stopping_fit(spark, tmp_path, path, callback):
    """A 3-epoch, 2-rank fit with ``callback`` (which asks one rank to stop); the stall watchdog at 120 s."""

    def make():
        keras.utils.set_random_seed(5)
        x = keras.Input((8,))
        model = keras.Model(x, keras.layers.Dense(1)(_dense_trunk(x)))
        model.compile("sgd", "mse")
        return model

    return _hvd_fit(
        spark,
        tmp_path / "s",
        path,
        make,
        ["x"],
        ["price"],
        num_proc=2,
        epochs=3,
        callbacks=[callback],
        stall_timeout=120,
    )


def test_stop_training_on_one_rank_stops_all(spark, tmp_path, table):
    """Issue 36.6: one rank's model.stop_training left the other waiting in an allreduce until the stall
    watchdog (300 s) failed the fit, blaming rank 0. Keras stops after that step: so do all ranks."""
    path, _ = table

    fitted = _stopping_fit(spark, tmp_path, path, _StopOnRank(1, 2))
    summary = fitted.getFitSummary()
    assert [r.iterations for r in summary.ranks] == [2, 2]  # both stopped after step 2 of epoch 1
    assert len(fitted.getHistory()["loss"]) == 1


class _StopAtEpochBegin(keras.callbacks.Callback):
    """Asks to stop at the start of an epoch, on one rank only (no step hooks)."""

    def __init__(self, rank: int, epoch: int):
        super().__init__()
        self.rank, self.epoch = rank, epoch

    def on_epoch_begin(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() == self.rank and epoch == self.epoch:
            self.model.stop_training = True


def test_stop_training_at_an_epoch_start_on_one_rank_stops_all(spark, tmp_path, table):
    """As Keras in one process: a stop asked for at an epoch's start ends fit after that epoch's first step."""
    path, _ = table

    fitted = _stopping_fit(spark, tmp_path, path, _StopAtEpochBegin(0, 1))
    summary = fitted.getFitSummary()
    assert [r.iterations for r in summary.ranks] == [summary.steps_per_epoch + 1] * 2


class DriftingModel(keras.Model):
    """A train_step that moves a trainable weight by hand, without the optimizer (against the rule)."""

    def train_step(self, data):
        x, y = data[0], data[1]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        for v, g in zip(self.trainable_variables, grads):
            v.assign_sub(0.01 * g)  # local gradients: each rank drifts its own way
        return {"loss": loss}


def test_updates_outside_the_optimizer_are_reported_at_the_first_step(spark, tmp_path, table):
    """Issue 36.7: such a model trained every epoch, then failed with "gradient averaging did not hold.
    Please report this with your model"; now the first step says what the rule is."""
    path, _ = table
    x = keras.Input((8,))
    model = DriftingModel(x, keras.layers.Dense(1)(_dense_trunk(x)))
    model.compile("sgd", "mse")
    with pytest.raises(RankFailedError, match=r"after the first training step.*self\.optimizer"):
        _hvd_fit(
            spark,
            tmp_path / "s",
            path,
            lambda: model,
            ["x"],
            ["price"],
            num_proc=2,
            epochs=3,
            custom_objects={"DriftingModel": DriftingModel},
        )


class SubclassedRegressor(keras.Model):
    """The common Keras 3 pattern after Functional: layers in ``__init__``, a ``call`` of its own."""

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(
            units, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(7)
        )
        self.out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(8))

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return dict(super().get_config(), units=self.units)


def test_subclassed_model_is_built_from_the_columns(spark, tmp_path, table):
    """Issue 36.4: a subclassed model was refused before work ("model must be built with known input
    shapes"); plain Keras builds it on the first batch, and so does fit now, from the columns."""

    def make():
        model = SubclassedRegressor()
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        return model

    two = _differential(spark, tmp_path, table, make, ["x"], ["price"])
    path, data = table
    scored = two.transform(spark.read.parquet(path).where("is_val")).toPandas()
    expected = two.getModel().predict(np.stack(scored["x"].to_numpy()), verbose=0)[:, 0]
    np.testing.assert_allclose(scored["price__output"].to_numpy(dtype="float32"), expected, rtol=1e-5, atol=1e-6)


def test_file_writing_callbacks_land_in_the_run_outputs(spark, tmp_path, table):
    """Issue 36.10: a user's TensorBoard / CSVLogger / ModelCheckpoint with relative paths wrote into each
    rank's temporary working folder (deleted after the job) or raced on a shared one. Now they run on
    rank 0 only, and what they write is copied to <store>/runs/<run_id>/outputs/ after every epoch."""
    path, _ = table
    store = tmp_path / "s"

    def make():
        keras.utils.set_random_seed(9)
        x = keras.Input((8,))
        model = keras.Model(x, keras.layers.Dense(1)(_dense_trunk(x)))
        model.compile("adam", "mse")
        return model

    callbacks = [
        keras.callbacks.CSVLogger("history.csv"),
        keras.callbacks.TensorBoard(log_dir="tb", profile_batch=0),
        keras.callbacks.ModelCheckpoint("ckpt/epoch-{epoch}.keras"),
    ]
    fitted = _hvd_fit(
        spark, store, path, make, ["x"], ["price"], num_proc=2, epochs=2, callbacks=callbacks, run_id="outputs"
    )
    outputs = store / "runs" / "outputs" / "outputs"
    lines = (outputs / "history.csv").read_text().strip().splitlines()
    assert lines[0].split(",")[0] == "epoch" and len(lines) == 3, lines  # one writer: a header and two epochs
    header = lines[0].split(",")
    losses = [float(line.split(",")[header.index("loss")]) for line in lines[1:]]
    np.testing.assert_allclose(losses, fitted.getHistory()["loss"], rtol=1e-6)
    assert any(name.startswith("events.out") for _, _, files in os.walk(outputs / "tb") for name in files)
    saved = keras.models.load_model(str(outputs / "ckpt" / "epoch-2.keras"))
    for a, b in zip(saved.get_weights(), fitted.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)


def test_backup_and_restore_is_refused_before_work(spark, tmp_path, table):
    path, _ = table
    x = keras.Input((8,))
    model = keras.Model(x, keras.layers.Dense(1)(x))
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="BackupAndRestore.*run_id"):
        _hvd_fit(
            spark,
            tmp_path / "s",
            path,
            lambda: model,
            ["x"],
            ["price"],
            num_proc=2,
            epochs=1,
            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))],
        )
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("*.parquet"))


# A user's script: custom classes defined in __main__ (registered ones passed as the estimator's loss and
# metrics, a registered Model subclass with its own train_step), and a notebook cell run with exec in a
# namespace of its own (an unregistered layer and activation), as IPython runs cells.
MAIN_SCRIPT = r'''
import json, sys
import numpy as np, keras, tensorflow as tf
import hvd_spark
from hvd_spark import HorovodEstimator

@keras.saving.register_keras_serializable(package="fidelity")
class L2StepModel(keras.Model):
    """Its own train_step: the loss plus an L2 penalty, through self.optimizer."""
    def train_step(self, data):
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            penalty = tf.add_n([tf.reduce_sum(tf.square(w)) for w in self.trainable_weights if "kernel" in w.path])
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred) + 1e-3 * penalty
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        for m in self.metrics:
            if m.name == "loss":
                m.update_state(loss)
            else:
                m.update_state(y, y_pred)
        return {"l2": penalty, **{m.name: m.result() for m in self.metrics}}

@keras.saving.register_keras_serializable(package="fidelity")
class ScaledMSE(keras.losses.Loss):
    def __init__(self, scale=2.0, **kw):
        super().__init__(**kw)
        self.scale = scale
    def call(self, y_true, y_pred):
        return self.scale * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
    def get_config(self):
        return dict(super().get_config(), scale=self.scale)

@keras.saving.register_keras_serializable(package="fidelity")
class HalfMAE(keras.metrics.Mean):
    def __init__(self, name="half_mae", **kw):
        super().__init__(name=name, **kw)
    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(keras.ops.abs(y_true - y_pred) / 2, sample_weight=sample_weight)

CELL = """
import keras
class Shift(keras.layers.Layer):
    def __init__(self, by=0.5, **kw):
        super().__init__(**kw)
        self.by = by
    def call(self, x):
        return x + self.by
    def get_config(self):
        return dict(super().get_config(), by=self.by)
def soft_clip(x):
    return 3.0 * keras.ops.tanh(x / 3.0)
"""
notebook = {"__name__": "__main__"}
exec(CELL, notebook)

store, path = sys.argv[1], sys.argv[2]
spark = hvd_spark.local_session("local[2]")
keras.utils.set_random_seed(3)
x = keras.Input((8,), name="x")
h = notebook["Shift"]()(keras.layers.Dense(16, activation=notebook["soft_clip"])(x))
model = L2StepModel(x, keras.layers.Dense(1)(h))
model.compile("adam", "mse")
df = spark.read.parquet(path)
est = HorovodEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(0.01),
                       loss=ScaledMSE(), metrics=[HalfMAE()], feature_cols=["x"], label_cols=["price"],
                       validation="is_val", batch_size=16, epochs=2, shuffle=False, verbose=0)
fitted = est.fit(df)
val = df.where("is_val").toPandas()
vx, vy = np.stack(val["x"].to_numpy()).astype("float32"), val["price"].to_numpy(dtype="float32")[:, None]
trained = fitted.getModel()
evaluated = trained.evaluate(vx, vy, batch_size=16, verbose=0, return_dict=True)
scored = fitted.transform(df.where("is_val")).toPandas()
print("RESULT " + json.dumps({
    "history": fitted.getHistory(),
    "evaluated": {k: float(v) for k, v in evaluated.items()},
    "model_class": type(trained).__name__,
    "loss_class": type(trained.loss).__name__,
    "predicted": scored["price__output"].astype(float).tolist(),
    "expected": trained.predict(np.stack(scored["x"].to_numpy()), verbose=0)[:, 0].astype(float).tolist(),
}))
spark.stop()
'''


def test_custom_classes_from_main_and_a_notebook_cell(tmp_path, table):
    """Issue 36.3: a registered Model subclass with its own train_step, or a registered loss / metric given
    as the loss= / metrics= Params, failed on the ranks after the data was written ("Could not locate
    class 'L2StepModel'"). What the model and Params need now travels to the ranks by value."""
    from _helpers import run_result_script

    path, _ = table
    data = run_result_script(MAIN_SCRIPT, str(tmp_path / "store"), path, cwd=tmp_path)
    h = data["history"]
    assert data["model_class"] == "L2StepModel" and data["loss_class"] == "ScaledMSE", data
    assert len(h["l2"]) == 2 and h["l2"][-1] > 0  # the user's train_step ran (its own log)
    for key in ("loss", "half_mae"):
        assert h[f"val_{key}"][-1] == pytest.approx(data["evaluated"][key], rel=1e-5), (key, h, data["evaluated"])
    np.testing.assert_allclose(data["predicted"], data["expected"], rtol=1e-5, atol=1e-6)
