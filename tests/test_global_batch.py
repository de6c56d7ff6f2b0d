"""The differential suite's global-batch standard: 2 ranks at batch B train as plain Keras at 2B.

Averaged gradients of equal per-rank batches are the gradient of the global batch, so a fit on 2 ranks
(real Spark ``local[2]``, real Horovod over Gloo) at ``batch_size`` B must equal Keras' own ``fit`` in
this process at batch 2B on the same rows: every key of the history (training metrics included) and the
final weights, to 1e-5. The table is one Parquet file of one row group read in place with
``shuffle=False``: rank r reads the r-th contiguous half of the training rows, so plain Keras is given
the rows interleaved by blocks of B (its batch k is rank 0's batch k, then rank 1's). Validation runs at
B in both (``validation_batch_size``), where each rank evaluates its own half of the validation rows.

Each case is a model family users bring. Where equality cannot hold (Dropout's per-rank masks), the case
says so and checks the documented rule instead.
"""

import sys

import cloudpickle
import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _helpers import fit_in_place

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # model factories and closures travel by value

ROWS, VAL_ROWS, B = 128, 64, 16  # 2 ranks: 4 steps of 16 rows each per epoch, 2 validation batches each
RTOL, ATOL = 1e-5, 1e-6
VOCAB, STEPS = 40, 12


def _write(tmp_path, columns: dict) -> str:
    def arrow(v):
        if v.ndim == 1:
            return pa.array(v)
        flat = v.reshape(len(v), -1)
        kind = pa.int64() if v.dtype.kind == "i" else pa.float32()
        return pa.array(list(flat), type=pa.list_(kind))

    n = len(next(iter(columns.values())))
    table = pa.table({**{k: arrow(v) for k, v in columns.items()}, "is_val": np.arange(n) >= ROWS})
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = str(tmp_path / "table.parquet")
    pq.write_table(table, path, row_group_size=n)
    return path


def _interleaved(n: int, size: int = 2) -> np.ndarray:
    """The order in which one process at ``size * B`` sees the rows that ``size`` ranks read at B."""
    share = n // size
    blocks = [np.arange(r * share + k * B, r * share + (k + 1) * B) for k in range(share // B) for r in range(size)]
    return np.concatenate(blocks)


def _plain(make, columns, features, labels, epochs, *, weight=None):
    train = np.arange(ROWS)
    order = _interleaved(ROWS)
    val = np.arange(ROWS, ROWS + VAL_ROWS)

    def pick(names, rows):
        values = [columns[n][rows] for n in names]
        return values[0] if len(values) == 1 else values

    def pick_y(rows):
        return columns[labels[0]][rows] if len(labels) == 1 else {n: columns[n][rows] for n in labels}

    model = make()
    sw = columns[weight][train][order] if weight else None
    vdata = (pick(features, val), pick_y(val)) + ((columns[weight][val],) if weight else ())
    history = model.fit(
        pick(features, train[order]),
        pick_y(train[order]),
        sample_weight=sw,
        batch_size=2 * B,
        epochs=epochs,
        shuffle=False,
        validation_data=vdata,
        validation_batch_size=B,
        verbose=0,
    )
    return model, history.history


def _two_ranks(spark, tmp_path, path, make, features, labels, epochs, **params):
    return fit_in_place(
        spark, tmp_path / "store", path, make(), features, labels, num_proc=2, batch=B, epochs=epochs, **params
    )


def global_batch(spark, tmp_path, make, columns, features, labels, *, epochs=2, weight=None, make_plain=None, **params):
    """Asserts that 2 ranks at B equal plain Keras at 2B; returns (fitted, plain model, plain history).
    ``make_plain``: the plain model, when the estimator's Params (``params``) change how it compiles."""
    path = _write(tmp_path, columns)
    plain, want = _plain(make_plain or make, columns, features, labels, epochs, weight=weight)
    extra = dict(params, **({"sample_weight_col": weight} if weight else {}))
    fitted = _two_ranks(spark, tmp_path, path, make, features, labels, epochs, **extra)
    got = fitted.getHistory()
    assert set(got) == set(want), (sorted(got), sorted(want))
    for i, (a, b) in enumerate(zip(fitted.getModel().get_weights(), plain.get_weights())):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=RTOL, atol=ATOL, err_msg=f"history[{key!r}]")
    return fitted, plain, want


def _ids(rng, n, *, pad: bool = False) -> np.ndarray:
    ids = rng.integers(1, VOCAB, size=(n, STEPS)).astype("int64")
    if pad:  # sequences of 3..12 tokens, padded with 0 at the end (mask_zero)
        lengths = rng.integers(3, STEPS + 1, size=n)
        ids[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    return ids


def _sequence_data(seed=0, pad=False):
    rng = np.random.default_rng(seed)
    n = ROWS + VAL_ROWS
    ids = _ids(rng, n, pad=pad)
    score = (np.where(ids > 0, ids, 0) % 7).sum(axis=1) / STEPS
    return {"ids": ids, "y": (score > np.median(score)).astype("float32")}


def _optimizer(name):
    return {
        "adam": lambda: keras.optimizers.Adam(0.02),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1),
        "sgd": lambda: keras.optimizers.SGD(0.1),
    }[name]()


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
@pytest.mark.parametrize("opt", ["adam", "rmsprop", "adagrad"])
def test_embedding_sparse_gradients(spark, tmp_path, opt, masked):
    """Issue 46.1: an Embedding's gradient was made dense before the allreduce, so Adam, RMSprop and
    Adagrad took their dense update where plain Keras, given IndexedSlices, takes the sparse one (whose
    moments count an id looked up k times in a batch k times): weights 0.16 (Adam), 0.14 (RMSprop) and
    1.2e-5 (Adagrad) apart after 2 epochs. Masked: padded sequences, mask_zero and masked pooling."""

    def make():
        keras.utils.set_random_seed(1)
        x = keras.Input((STEPS,), dtype="int64", name="ids")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8, mask_zero=masked)(x))
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile(_optimizer(opt), "binary_crossentropy", metrics=["accuracy"])
        return model

    global_batch(spark, tmp_path, make, _sequence_data(pad=masked), ["ids"], ["y"])


def test_masked_embedding_lstm(spark, tmp_path):
    """Embedding(mask_zero) + LSTM + Adam: sparse gradients through a masked recurrent layer."""

    def make():
        keras.utils.set_random_seed(2)
        x = keras.Input((STEPS,), dtype="int64", name="ids")
        h = keras.layers.LSTM(8)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(x))
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy", metrics=["accuracy"])
        return model

    global_batch(spark, tmp_path, make, _sequence_data(pad=True), ["ids"], ["y"])


def test_masked_sequence_loss_gru_tagger(spark, tmp_path):
    """Issue 46.6: a GRU tagger with mask_zero and one-hot tags: Keras divides each batch's loss by its
    unmasked steps; 2 ranks weighed their batches alike (training loss 1e-2 and weights 5e-3 apart).
    Now the ranks agree on the global batch's count of unmasked steps."""
    rng = np.random.default_rng(3)
    n = ROWS + VAL_ROWS
    ids = _ids(rng, n, pad=True)
    tags = np.eye(3, dtype="float32")[ids % 3]

    def make():
        keras.utils.set_random_seed(3)
        x = keras.Input((STEPS,), dtype="int64", name="ids")
        h = keras.layers.GRU(8, return_sequences=True)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(x))
        model = keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.02), "categorical_crossentropy", metrics=["categorical_accuracy"])
        return model

    global_batch(spark, tmp_path, make, {"ids": ids, "tags": tags}, ["ids"], ["tags"])


def test_ignore_class_sparse_tagger(spark, tmp_path):
    """A tagger whose padded steps have the label -1, left out by
    ``SparseCategoricalCrossentropy(ignore_class=-1)`` (no Keras mask on the output): Keras divides each
    batch's loss by its labels that are not -1, so the ranks take the global batch's count of them."""
    rng = np.random.default_rng(4)
    ids = _ids(rng, ROWS + VAL_ROWS, pad=True)
    tags = np.where(ids > 0, ids % 3, -1).astype("int64")

    def make():
        keras.utils.set_random_seed(4)
        x = keras.Input((STEPS,), dtype="int64", name="ids")
        h = keras.layers.GRU(8, return_sequences=True)(keras.layers.Embedding(VOCAB, 8)(x))
        model = keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.02), keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
        return model

    global_batch(spark, tmp_path, make, {"ids": ids, "tags": tags}, ["ids"], ["tags"])


def test_transformer_encoder_block(spark, tmp_path):
    """MultiHeadAttention, LayerNormalization, a residual feed-forward block over token embeddings."""

    def make():
        keras.utils.set_random_seed(4)
        x = keras.Input((STEPS,), dtype="int64", name="ids")
        e = keras.layers.Embedding(VOCAB, 16)(x)
        a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(e, e)
        h = keras.layers.LayerNormalization()(e + a)
        f = keras.layers.Dense(16)(keras.layers.Dense(32, activation="relu")(h))
        h = keras.layers.LayerNormalization()(h + f)
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(x, out)
        model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy", metrics=["accuracy"])
        return model

    global_batch(spark, tmp_path, make, _sequence_data(seed=4), ["ids"], ["y"])


def test_conv2d(spark, tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[: ROWS + VAL_ROWS] / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    y = digits.target[: ROWS + VAL_ROWS].astype("int64")

    def make():
        keras.utils.set_random_seed(5)
        inp = keras.Input((8, 8, 1), name="image")
        h = keras.layers.Conv2D(8, 3, activation="relu")(inp)
        h = keras.layers.Flatten()(keras.layers.MaxPooling2D()(h))
        model = keras.Model(inp, keras.layers.Dense(10, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    global_batch(spark, tmp_path, make, {"image": x, "digit": y}, ["image"], ["digit"])


def _tabular(seed=6):
    rng = np.random.default_rng(seed)
    n = ROWS + VAL_ROWS
    x = rng.normal(size=(n, 8)).astype("float32")
    score = x @ rng.normal(size=(8,)).astype("float32")
    return {
        "x": x,
        "price": (score + 0.1 * rng.normal(size=n)).astype("float32"),
        "count": (np.abs(score) + 0.1 * rng.normal(size=n)).astype("float32"),
        "rare": (score > np.quantile(score, 0.8)).astype("float32"),  # 20% positives: imbalanced
        "weight": rng.uniform(0.5, 2.0, size=n).astype("float32"),
    }


def test_multi_output_with_loss_weights(spark, tmp_path):
    def make():
        keras.utils.set_random_seed(6)
        x = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="tanh")(x)
        outputs = {"price": keras.layers.Dense(1, name="price")(h), "count": keras.layers.Dense(1, name="count")(h)}
        model = keras.Model(x, outputs)
        model.compile(
            keras.optimizers.Adam(0.01),
            loss={"price": "mse", "count": "mae"},
            loss_weights={"price": 1.0, "count": 0.5},
            metrics={"price": ["mae"], "count": [keras.metrics.RootMeanSquaredError(name="rmse")]},
        )
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price", "count"])


def test_training_auc_precision_recall(spark, tmp_path):
    """Issue 46.2: training metrics were the mean of the ranks' values (precision 0.667 where plain
    Keras gives 0.5 on an imbalanced set); now their states are summed over the ranks, as validation's."""

    def make():
        keras.utils.set_random_seed(7)
        x = keras.Input((8,), name="x")
        h = keras.layers.Dense(8, activation="tanh")(x)
        model = keras.Model(x, keras.layers.Dense(1, activation="sigmoid")(h))
        model.compile(
            keras.optimizers.SGD(0.05),
            "binary_crossentropy",
            metrics=[
                keras.metrics.AUC(name="auc"),
                keras.metrics.Precision(name="precision"),
                keras.metrics.Recall(name="recall"),
            ],
        )
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["rare"])


def test_weighted_mean_loss_and_weighted_metrics(spark, tmp_path):
    """A loss reduced with "mean_with_sample_weight" divides by the batch's sum of weights: the ranks
    agree on the global batch's sum."""

    def make():
        keras.utils.set_random_seed(8)
        x = keras.Input((8,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(x)))
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
            weighted_metrics=[keras.metrics.MeanAbsoluteError(name="wmae")],
        )
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price"], weight="weight")


def test_sum_reduction(spark, tmp_path):
    """A loss reduced with "sum" is the sum over the global batch, not the ranks' mean of sums."""

    def make():
        keras.utils.set_random_seed(9)
        x = keras.Input((8,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(x))
        model.compile(keras.optimizers.SGD(0.001), keras.losses.MeanSquaredError(reduction="sum"))
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price"])


def test_synchronized_batch_norm(spark, tmp_path):
    """BatchNormalization(synchronized=True): statistics over the global batch on every step, so the
    standard holds (a plain BatchNormalization normalises each rank's batch by its own statistics:
    docs/estimator.md, "Layers with state of their own")."""

    def make():
        keras.utils.set_random_seed(10)
        x = keras.Input((8,), name="x")
        h = keras.layers.BatchNormalization(synchronized=True)(keras.layers.Dense(8, use_bias=False)(x))
        model = keras.Model(x, keras.layers.Dense(1)(keras.layers.Activation("tanh")(h)))
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price"])


def test_dropout_rule(spark, tmp_path):
    """Dropout draws its masks per rank (seeded by seed, rank and epoch: docs/estimator.md, "Randomness"),
    so 2 ranks cannot equal one process. The rule checked instead: the same seed gives the same model
    twice, every rank ends with the same weights, and val_* equals evaluate of the returned model."""
    columns = _tabular()

    def make():
        keras.utils.set_random_seed(11)
        x = keras.Input((8,), name="x")
        h = keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="tanh")(x))
        model = keras.Model(x, keras.layers.Dense(1)(h))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    path = _write(tmp_path, columns)
    first = _two_ranks(spark, tmp_path / "a", path, make, ["x"], ["price"], 2)
    second = _two_ranks(spark, tmp_path / "b", path, make, ["x"], ["price"], 2)
    for a, b in zip(first.getModel().get_weights(), second.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)
    val = np.arange(ROWS, ROWS + VAL_ROWS)
    evaluated = first.getModel().evaluate(
        columns["x"][val], columns["price"][val], batch_size=B, verbose=0, return_dict=True
    )
    assert first.getHistory()["val_loss"][-1] == pytest.approx(evaluated["loss"], rel=1e-5)


SCALE = 1.5  # a global the Lambda below reads: it travels with the function (cloudpickle), not by name


def test_lambda_layer_travels_to_the_ranks_and_to_transform(spark, tmp_path):
    """Issue 46.3: a Lambda layer with a Python lambda failed on the ranks ("Requested the deserialization
    of a Lambda layer whose function is a Python lambda"). It travels by value now; Keras' safe mode
    stays on wherever hvd_spark loads the model (no bytecode from a file runs)."""
    columns = _tabular()

    def make():
        keras.utils.set_random_seed(12)
        x = keras.Input((8,), name="x")
        h = keras.layers.Lambda(lambda t: keras.ops.tanh(t) * SCALE)(keras.layers.Dense(8)(x))
        model = keras.Model(x, keras.layers.Dense(1)(h))
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        return model

    fitted, _, _ = global_batch(spark, tmp_path, make, columns, ["x"], ["price"])
    path = str(tmp_path / "table.parquet")
    scored = fitted.transform(spark.read.parquet(path).where("is_val")).toPandas()
    expected = fitted.getModel().predict(np.stack(scored["x"].to_numpy()), verbose=0)[:, 0]
    np.testing.assert_allclose(scored["price__output"].to_numpy(dtype="float32"), expected, rtol=1e-5, atol=1e-6)

    # In a new process, TFTransformer.load follows Keras' safe mode: refused with a clear message, loaded
    # with safe_mode=False, predicting as before.
    from _helpers import run_result_script

    saved = str(tmp_path / "transformer")
    fitted.save(saved)
    data = run_result_script(LOAD_SCRIPT, saved, path, cwd=tmp_path)
    assert "safe_mode=False" in data["refused"] and "1 Python lambda" in data["refused"], data
    np.testing.assert_allclose(data["predicted"], expected, rtol=1e-5, atol=1e-6)


LOAD_SCRIPT = r"""
import json, sys
import hvd_spark
from hvd_spark import TFTransformer

saved, path = sys.argv[1], sys.argv[2]
spark = hvd_spark.local_session("local[1]")
try:
    TFTransformer.load(saved)
    refused = ""
except ValueError as e:
    refused = str(e)
loaded = TFTransformer.load(saved, safe_mode=False)
scored = loaded.transform(spark.read.parquet(path).where("is_val")).toPandas()
print("RESULT " + json.dumps({"refused": refused, "predicted": scored["price__output"].astype(float).tolist()}))
spark.stop()
"""


def make_loss(alpha):
    """A loss factory, as users write them: every loss it returns is a closure named ``loss_fn``."""

    def loss_fn(y_true, y_pred):
        return keras.ops.mean(alpha * keras.ops.square(y_true - y_pred), axis=-1)

    return loss_fn


def _two_outputs(loss=None):
    keras.utils.set_random_seed(13)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh")(x)
    model = keras.Model(
        x, {"price": keras.layers.Dense(1, name="price")(h), "count": keras.layers.Dense(1, name="count")(h)}
    )
    model.compile(keras.optimizers.Adam(0.01), loss=loss or {"price": "mse", "count": "mse"})
    return model


def test_two_closures_of_one_factory_stay_two(spark, tmp_path):
    """Issue 46.7: loss={"price": make_loss(1.0), "count": make_loss(4.0)} compiled into the model trained
    count with price's alpha (count_loss 0.62 where plain Keras gives 1.20): the user's functions were keyed
    by __name__, so the first closure won. Each closure travels as itself now."""

    def make():
        return _two_outputs({"price": make_loss(1.0), "count": make_loss(4.0)})

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price", "count"])


def test_closures_and_a_lambda_as_the_loss_param(spark, tmp_path):
    """The same closures given as the loss Param (trained right before, but the returned model's
    loss["count"] was price's function), and a Python lambda as the loss (OSError: could not get source
    code, when the rank saved its checkpoint)."""
    losses = {"price": make_loss(1.0), "count": make_loss(4.0)}
    fitted, _, _ = global_batch(
        spark,
        tmp_path / "a",
        _two_outputs,
        _tabular(),
        ["x"],
        ["price", "count"],
        make_plain=lambda: _two_outputs(losses),
        loss=losses,
    )
    returned = fitted.getModel().loss
    alphas = {k: returned[k].__closure__[0].cell_contents for k in ("price", "count")}
    assert alphas == {"price": 1.0, "count": 4.0}, alphas

    def square(y, p):
        return keras.ops.mean(keras.ops.square(y - p), axis=-1)

    as_lambda = lambda y, p: keras.ops.mean(keras.ops.abs(y - p), axis=-1)  # noqa: E731

    def single(loss=None):
        keras.utils.set_random_seed(14)
        x = keras.Input((8,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(x)))
        model.compile(keras.optimizers.Adam(0.01), loss or square)
        return model

    global_batch(
        spark,
        tmp_path / "b",
        single,
        _tabular(),
        ["x"],
        ["price"],
        make_plain=lambda: single(as_lambda),
        loss=as_lambda,
    )


def test_unreduced_loss(spark, tmp_path):
    """reduction=None: Keras differentiates the sum of the per-row values; each rank's sum is 1/N of the
    global batch's, so the ranks scale its gradient by N (the values reported stay as they are)."""

    def make():
        keras.utils.set_random_seed(15)
        x = keras.Input((8,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(x))
        model.compile(keras.optimizers.SGD(0.001), keras.losses.MeanSquaredError(reduction=None))
        return model

    global_batch(spark, tmp_path, make, _tabular(), ["x"], ["price"])


def scale_by(k):
    """Lambdas of one code that differ by their closure (a numpy scalar, as Keras saves it)."""
    return lambda t: t * k


def test_two_fits_with_lambdas_of_one_code_load_side_by_side(spark, tmp_path):
    """Each fit's lambdas keep their own closure: in one driver, the models of two fits (and their
    transforms) each compute with their own function, not the first one loaded."""
    columns = _tabular()
    path = _write(tmp_path, columns)
    fitted = {}
    for k in (2.0, 3.0):

        def make(k=k):
            keras.utils.set_random_seed(16)
            x = keras.Input((8,), name="x")
            h = keras.layers.Lambda(scale_by(np.float32(k)), name="scale")(keras.layers.Dense(4)(x))
            model = keras.Model(x, keras.layers.Dense(1)(h))
            model.compile(keras.optimizers.SGD(0.001), "mse")
            return model

        fitted[k] = _two_ranks(spark, tmp_path / str(k), path, make, ["x"], ["price"], 1)
    for k, f in fitted.items():
        layer = f.getModel().get_layer("scale")
        assert float(layer.function(np.float32(1.0))) == k, k
        scored = f.transform(spark.read.parquet(path).where("is_val")).toPandas()
        expected = f.getModel().predict(np.stack(scored["x"].to_numpy()), verbose=0)[:, 0]
        np.testing.assert_allclose(scored["price__output"].to_numpy(dtype="float32"), expected, rtol=1e-5, atol=1e-6)
