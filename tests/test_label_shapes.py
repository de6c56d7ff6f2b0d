"""Labels as Keras takes them (issue 46, points 4 and 8).

- Per-step sparse labels: a tagging model (output ``(None, 12, 3)``) trained with
  ``sparse_categorical_crossentropy`` on an ``array<int>`` of 12 class ids per row, as plain Keras trains
  sequence taggers: 2 ranks, ``val_*`` equal to ``model.evaluate`` of the validation rows; ``label_shapes``
  ``[[12]]`` accepted; a label of the wrong length refused before any rank starts, naming the column.
- A subclassed model the user called once on int64 ids: the ranks and ``transform`` feed it the column's
  int64 ids (not float32, which turns ids above 2^24 into other ids).
- Stacked label columns for a multi-label output: ``label_cols=[["a", "b", "c"]]``.
- ``fit(df, initial_epoch=3)`` and other ``keras.Model.fit`` arguments: a TypeError naming the Param.

Tables are small Parquet files read in place (``materialize="never"``), training rows first, then the
validation rows (``shuffle=False``)."""

import sys

import cloudpickle
import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark import HorovodEstimator

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the model classes travel to the ranks by value

STEPS, TAGS, VOCAB = 12, 3, 20
ROWS, VAL_ROWS, BATCH = 192, 64, 16  # 2 ranks: 32 validation rows each, two full batches
RTOL, ATOL = 1e-5, 1e-6


def _tagging_table(path, steps: int = STEPS, label_steps: int = STEPS):
    """Token ids and one tag per token (a function of the token)."""
    rng = np.random.default_rng(3)
    n = ROWS + VAL_ROWS
    tokens = rng.integers(1, VOCAB, size=(n, steps)).astype("int32")
    tags = (tokens % TAGS).astype("int32")[:, :label_steps]
    columns = {
        "tokens": pa.array(list(tokens), type=pa.list_(pa.int32())),
        "tags": pa.array(list(tags), type=pa.list_(pa.int32())),
        "is_val": np.arange(n) >= ROWS,
    }
    pq.write_table(pa.table(columns), path, row_group_size=n)
    return tokens, tags, np.arange(n) >= ROWS


def _tagger():
    keras.utils.set_random_seed(5)
    tokens = keras.Input(shape=(STEPS,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, 8)(tokens)
    out = keras.layers.Dense(TAGS, activation="softmax", name="tags")(h)  # (None, 12, 3): one class per step
    model = keras.Model(tokens, out)
    model.compile(
        keras.optimizers.Adam(0.01),
        "sparse_categorical_crossentropy",
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc"), "sparse_categorical_accuracy"],
    )
    return model


def _estimator(store, model, features, labels, **params):
    defaults = dict(
        num_proc=2,
        store=str(store),
        model=model,
        feature_cols=features,
        label_cols=labels,
        batch_size=BATCH,
        val_batch_size=BATCH,
        epochs=2,
        shuffle=False,
        materialize="never",
        verbose=0,
    )
    return HorovodEstimator(**{**defaults, **params})


def test_per_step_sparse_labels_train_as_in_keras(spark, tmp_path):
    """Issue 46.4: refused before work ("label column 'tags' has 12 values per row"). Now the 12 ids
    reach Keras as a (12,) label per row: 2 ranks, every val_* equals evaluate on the validation rows."""
    path = str(tmp_path / "tags.parquet")
    tokens, tags, is_val = _tagging_table(path)
    fitted = _estimator(tmp_path / "store", _tagger(), ["tokens"], ["tags"], validation="is_val", epochs=3).fit(
        spark.read.parquet(path)
    )
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1
    history, model = fitted.getHistory(), fitted.getModel()
    evaluated = model.evaluate(tokens[is_val], tags[is_val], batch_size=BATCH, verbose=0, return_dict=True)
    assert set(evaluated) == {"loss", "acc", "sparse_categorical_accuracy"}, evaluated
    for key, value in evaluated.items():
        np.testing.assert_allclose(history[f"val_{key}"][-1], value, rtol=RTOL, atol=ATOL, err_msg=key)
    assert history["acc"][-1] > 0.9, history  # it learns the tags
    # transform: the per-step output as its flat prediction column (12 x 3 values), no classifier columns
    scored = fitted.transform(spark.read.parquet(path).where("is_val")).toPandas()
    assert "prediction" not in scored.columns, scored.columns
    got = np.stack(scored["tags__output"].to_numpy())
    expected = model.predict(np.stack(scored["tokens"].to_numpy()), verbose=0).reshape(len(scored), -1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_label_shapes_of_per_step_labels_and_a_wrong_length(spark, tmp_path):
    """label_shapes=[[12]] (the ids' shape) is accepted; 11 ids per row for 12 steps are refused before
    any rank starts, naming the column and both lengths; so is label_shapes=[[11]]."""
    path = str(tmp_path / "tags.parquet")
    _tagging_table(path)
    fitted = _estimator(tmp_path / "store", _tagger(), ["tokens"], ["tags"], num_proc=1, epochs=1, label_shapes=[[12]])
    fitted = fitted.fit(spark.read.parquet(path))
    assert np.isfinite(fitted.getHistory()["loss"][-1])

    with pytest.raises(ValueError, match=r"label_shapes: \[11\] holds 11 values; output 'tags' has shape \(12, 3\)"):
        _estimator(tmp_path / "s2", _tagger(), ["tokens"], ["tags"], label_shapes=[[11]]).fit(spark.read.parquet(path))

    short = str(tmp_path / "short.parquet")
    _tagging_table(short, label_steps=11)
    store = tmp_path / "s3"
    with pytest.raises(ValueError, match=r"label column 'tags' has 11 values per row\. Expected 12 \(one class"):
        _estimator(store, _tagger(), ["tokens"], ["tags"]).fit(spark.read.parquet(short))
    assert not (store / "runs").exists() or not any((store / "runs").rglob("*.keras"))  # no rank trained

    tokens, tags, is_val = _tagging_table(str(tmp_path / "ok.parquet"))
    tags[5, 7] = TAGS  # one id beyond the 3 classes
    bad = str(tmp_path / "bad.parquet")
    columns = {"tokens": pa.array(list(tokens)), "tags": pa.array(list(tags)), "is_val": is_val}
    pq.write_table(pa.table(columns), bad)
    with pytest.raises(ValueError, match=r"label column 'tags' holds class indices for output 'tags', which has 3 "):
        _estimator(tmp_path / "s4", _tagger(), ["tokens"], ["tags"]).fit(spark.read.parquet(bad))


def smoothed_sparse_loss(y_true, y_pred):
    """A user's own sparse loss (not Keras' by name): class ids in, per-step probabilities out."""
    ids = keras.ops.cast(y_true, "int32")
    picked = keras.ops.take_along_axis(y_pred, keras.ops.expand_dims(ids, -1), axis=-1)[..., 0]
    return -keras.ops.mean(keras.ops.log(0.9 * picked + 0.1 / TAGS), axis=-1)


def test_a_custom_sparse_loss_opts_in_with_label_shapes(spark, tmp_path):
    """hvd_spark knows Keras' sparse losses by name; a user's own takes per-step ids when label_shapes gives
    the ids' shape ((12,) for the output (12, 3)); without it the 12 ids are refused (12 or 36 values)."""
    path = str(tmp_path / "tags.parquet")
    tokens, tags, is_val = _tagging_table(path)

    def tagger():
        model = _tagger()
        model.compile(keras.optimizers.Adam(0.01), smoothed_sparse_loss)
        return model

    with pytest.raises(ValueError, match=r"label column 'tags' has 12 values per row"):
        _estimator(tmp_path / "s1", tagger(), ["tokens"], ["tags"]).fit(spark.read.parquet(path))
    fitted = _estimator(
        tmp_path / "s2", tagger(), ["tokens"], ["tags"], validation="is_val", label_shapes=[[STEPS]]
    ).fit(spark.read.parquet(path))
    evaluated = fitted.getModel().evaluate(tokens[is_val], tags[is_val], batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(fitted.getHistory()["val_loss"][-1], evaluated["loss"], rtol=RTOL, atol=ATOL)


def test_per_pixel_sparse_labels(spark, tmp_path):
    """A per-pixel output (None, 4, 4, 3) with an array of 16 class ids per row, and label_shapes=[[4, 4]]."""
    rng = np.random.default_rng(1)
    n = 128
    pixels = rng.normal(size=(n, 16)).astype("float32")
    classes = np.digitize(pixels, [-0.5, 0.5]).astype("int32")  # 3 classes by value
    path = str(tmp_path / "pixels.parquet")
    pq.write_table(
        pa.table(
            {
                "pixels": pa.array(list(pixels), type=pa.list_(pa.float32())),
                "classes": pa.array(list(classes), type=pa.list_(pa.int32())),
            }
        ),
        path,
    )

    def make():
        keras.utils.set_random_seed(1)
        x = keras.Input(shape=(4, 4, 1), name="pixels")
        h = keras.layers.Conv2D(8, 1, activation="tanh")(x)
        model = keras.Model(x, keras.layers.Conv2D(3, 1, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
        return model

    for i, shapes in enumerate((None, [[4, 4]])):
        fitted = _estimator(
            tmp_path / f"store{i}", make(), ["pixels"], ["classes"], num_proc=1, epochs=4, label_shapes=shapes
        ).fit(spark.read.parquet(path))
        model = fitted.getModel()
        evaluated = model.evaluate(pixels.reshape(n, 4, 4, 1), classes.reshape(n, 4, 4), verbose=0, return_dict=True)
        assert evaluated["accuracy"] > 0.8, (shapes, evaluated)


ID_BASE, BUCKETS = 1 << 40, 97  # ids far above 2^24: float32 keeps none of their low bits


class HashedIds(keras.Model):
    """A subclassed model on raw int64 ids: an Embedding over the ids modulo 97 (a hashing trick)."""

    def __init__(self, buckets=BUCKETS, **kwargs):
        super().__init__(**kwargs)
        self.buckets = buckets
        self.embedding = keras.layers.Embedding(buckets, 2, embeddings_initializer=keras.initializers.Zeros())
        self.flatten = keras.layers.Flatten()

    def call(self, ids):
        return keras.ops.softmax(self.flatten(self.embedding(keras.ops.mod(ids, self.buckets))))

    def get_config(self):
        return dict(super().get_config(), buckets=self.buckets)


def test_subclassed_model_called_on_int64_ids_gets_them_whole(spark, tmp_path):
    """Issue 46.8a: a subclassed model called once on an int64 batch was fed float32 on the ranks and in
    transform (its build config keeps no dtypes): ids above 2^24 became other ids, accuracy stayed at the
    majority class. Now its inputs take the column's type (bigint: int64) and it learns every bucket."""
    rng = np.random.default_rng(0)
    n = 776
    ids = (ID_BASE + rng.integers(0, 1 << 30, size=n)).astype("int64")
    labels = ((ids % BUCKETS) % 2).astype("int64")  # a function of the exact id only
    path = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"id": ids, "y": labels}), path)
    model = HashedIds()
    model(np.array([[ID_BASE]], dtype="int64"))  # called once on a batch, as a Keras user builds it
    model.compile(keras.optimizers.Adam(0.5), "sparse_categorical_crossentropy", metrics=["accuracy"])
    fitted = _estimator(tmp_path / "store", model, ["id"], ["y"], epochs=8, shuffle=True).fit(spark.read.parquet(path))
    assert [s["dtype"] for s in fitted.getOrDefault("input_specs")] == ["int64"]  # what the ranks were fed
    assert fitted.getHistory()["accuracy"][-1] == 1.0, fitted.getHistory()["accuracy"]
    scored = fitted.transform(spark.read.parquet(path)).toPandas()
    assert (scored["prediction"].to_numpy() == scored["y"].to_numpy()).all()


def test_stacked_label_columns_for_a_multi_label_output(spark, tmp_path):
    """Issue 46.8b: label_cols=[["a", "b", "c"]] raised TypeError. Now three scalar label columns feed
    one output of shape (3,), as feature_cols stacks scalar columns into one input; transform too."""
    rng = np.random.default_rng(2)
    n = 256
    x = rng.normal(size=(n, 4)).astype("float32")
    columns = {"x": pa.array(list(x), type=pa.list_(pa.float32()))}
    for i, name in enumerate("abc"):
        columns[name] = (x[:, i] + x[:, 3] > 0).astype("int64")
    path = str(tmp_path / "multi.parquet")
    pq.write_table(pa.table(columns), path)
    keras.utils.set_random_seed(4)
    inputs = keras.Input(shape=(4,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="sigmoid")(inputs))
    model.compile(keras.optimizers.Adam(0.1), "binary_crossentropy", metrics=["binary_accuracy"])
    fitted = _estimator(tmp_path / "store", model, ["x"], [["a", "b", "c"]], epochs=6).fit(spark.read.parquet(path))
    assert fitted.getLabelCols() == [["a", "b", "c"]]
    assert fitted.getHistory()["binary_accuracy"][-1] > 0.9, fitted.getHistory()
    scored = fitted.transform(spark.read.parquet(path)).toPandas()
    got = np.stack(scored["a_b_c__output"].to_numpy())
    expected = fitted.getModel().predict(np.stack(scored["x"].to_numpy()), verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    truth = scored[["a", "b", "c"]].to_numpy()
    assert ((got > 0.5) == truth).mean() > 0.9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(initial_epoch=3), r"initial_epoch=3.*resumes a run at its next epoch.*run_id=.*epochs.*total"),
        (dict(batch_size=64), r"batch_size=64.*set the estimator's Param batch_size"),
        (dict(x=np.zeros(3)), r"x=.*feature_cols"),
    ],
)
def test_keras_fit_arguments_name_the_param(spark, kwargs, match):
    """Issue 46.8c: fit(df, initial_epoch=3) was a bare "unexpected keyword argument" TypeError."""
    est = HorovodEstimator(num_proc=1, store="/tmp/unused", model=_tagger(), feature_cols=["t"], label_cols=["y"])
    with pytest.raises(TypeError, match=match):
        est.fit(spark.range(1), **kwargs)
