"""Models as Keras users build them: a functional model on a dict of named inputs (one an integer
column through an Embedding), with a custom layer, trained on 2 real Horovod ranks and used by
transform; columns matched to inputs by name, in any order, or by an explicit mapping."""

import sys

import cloudpickle
import keras
import numpy as np
import pandas as pd
import pytest

import hvd_spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the custom layer travels to the ranks by value


@keras.saving.register_keras_serializable(package="hvd_spark_tests")
class Doubling(keras.layers.Layer):
    """A custom layer: twice its input."""

    def call(self, x):
        return x * 2.0


def _dict_model():
    num = keras.Input(shape=(7,), name="num")
    cat = keras.Input(shape=(1,), name="cat", dtype="int32")
    emb = keras.layers.Flatten()(keras.layers.Embedding(5, 4)(cat))
    h = keras.layers.Concatenate()([Doubling()(num), emb])
    h = keras.layers.Dense(16, activation="relu")(h)
    out = keras.layers.Dense(1, activation="sigmoid")(h)
    # keras.Model sorts a dict's inputs by key: model.inputs is [cat, num], not the dict's order.
    return keras.Model(inputs={"num": num, "cat": cat}, outputs=out)


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    n = 1200
    num = rng.normal(size=(n, 7)).astype("float32")
    cat = rng.integers(0, 5, size=n)
    y = ((num[:, :3].sum(1) + np.where(cat == 2, 2.5, -0.5)) > 0).astype("float64")
    pdf = pd.DataFrame({"num": list(num), "cat": cat.astype("int64"), "y": y})
    return spark.createDataFrame(pdf).repartition(4).cache()


def _estimator(tmp_path, feature_cols):
    keras.utils.set_random_seed(2)
    return hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=_dict_model(), optimizer=keras.optimizers.Adam(0.01),
        loss="binary_crossentropy", metrics=["accuracy"], feature_cols=feature_cols, label_cols=["y"],
        batch_size=32, epochs=6, verbose=0,
    )  # fmt: skip


def test_dict_inputs_matched_by_name_train_and_transform(frame, tmp_path):
    fitted = _estimator(tmp_path, ["num", "cat"]).fit(frame)  # the dict's order, not the model's
    assert fitted.getFeatureCols() == ["cat", "num"]  # recorded in the model's order
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1
    out = fitted.transform(frame).select("num", "cat", "y", "y__output", "prediction").toPandas()
    accuracy = float((out["prediction"] == out["y"]).mean())
    assert accuracy >= 0.9, accuracy
    # transform gives what the Keras model gives on a dict of named arrays.
    x = {"num": np.stack(out["num"].to_numpy()).astype("float32"), "cat": out["cat"].to_numpy().reshape(-1, 1)}
    expected = fitted.getModel().predict(x, verbose=0).ravel()
    np.testing.assert_allclose(out["y__output"].to_numpy(), expected, rtol=1e-4, atol=1e-5)


def test_an_explicit_mapping_with_stacked_scalar_columns_and_a_wrong_one(frame, tmp_path, spark):
    """{"num": [n0..n6], "cat": "category"}: seven scalar columns stacked (in that order) into one input."""
    from pyspark.sql import functions as F

    parts = [f"n{i}" for i in range(7)]
    renamed = frame.select(
        *[F.col("num")[i].cast("double").alias(p) for i, p in enumerate(parts)], F.col("cat").alias("category"), "y"
    )
    est = _estimator(tmp_path, {"num": parts, "cat": "category"})
    est.setEpochs(1)
    fitted = est.fit(renamed)
    assert fitted.getFeatureCols() == ["category", parts]
    out = fitted.transform(renamed).toPandas()
    x = {"num": out[parts].to_numpy().astype("float32"), "cat": out["category"].to_numpy().reshape(-1, 1)}
    np.testing.assert_allclose(out["y__output"], fitted.getModel().predict(x, verbose=0).ravel(), rtol=1e-4, atol=1e-5)
    # A null in one of the stacked columns: the error names the group; handleInvalid="keep" gives a null.
    holed = renamed.limit(3).withColumn("n3", F.when(F.col("y") >= 0, None).otherwise(F.col("n3")).cast("double"))
    with pytest.raises(Exception, match=r"Feature column '\[n0, n1, n2, n3, n4, n5, n6\]' has \d+ null values"):
        fitted.transform(holed).collect()
    assert {r["y__output"] for r in fitted.setHandleInvalid("keep").transform(holed).collect()} == {None}
    with pytest.raises(ValueError, match=r"Feature column '\[n0, n1, n2, n3, n4, n5, n6\]' has 3 of 3 rows with null"):
        _estimator(tmp_path, {"num": parts, "cat": "category"}).fit(holed)
    with pytest.raises(ValueError, match=r"feature_cols maps the model's inputs by name: expected the keys"):
        _estimator(tmp_path, {"num": parts, "kat": "category"}).fit(renamed)
    with pytest.raises(TypeError, match=r"are stacked into one model input.*\['num'\] hold several values"):
        _estimator(tmp_path, {"num": ["n0", "num"], "cat": "cat"}).fit(frame.withColumn("n0", F.lit(1.0)))


def test_thirteen_scalar_columns_feed_a_one_input_model(spark, tmp_path):
    """The wine data as a DataFrame of 13 numeric columns, and a model with one 13-wide input: no
    VectorAssembler; fit and transform stack the columns in the order given."""
    from sklearn.datasets import load_wine

    wine = load_wine(as_frame=True)
    x = wine.data
    pdf = ((x - x.mean()) / x.std()).assign(label=wine.target.astype("int64"))
    pdf.columns = [c.replace("/", "_") if c != "label" else c for c in pdf.columns]
    names = [c for c in pdf.columns if c != "label"]
    df = spark.createDataFrame(pdf).repartition(2).cache()
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((13,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=model, optimizer=keras.optimizers.Adam(0.02),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), feature_cols=names,
        label_cols=["label"], batch_size=16, epochs=15, verbose=0,
    )  # fmt: skip
    fitted = est.fit(df)
    assert fitted.getFeatureCols() == [names]
    out = fitted.transform(df).toPandas()
    assert float((out["prediction"] == out["label"]).mean()) >= 0.9
    logits = fitted.getModel().predict(out[names].to_numpy().astype("float32"), verbose=0)
    np.testing.assert_allclose(np.stack(out["label__output"].to_numpy()), logits, rtol=1e-4, atol=1e-5)


def test_dict_outputs_matched_to_label_columns_by_key(frame, tmp_path):
    num = keras.Input(shape=(7,), name="num")
    h = keras.layers.Dense(8, activation="relu")(num)
    outputs = {"prob": keras.layers.Dense(1, activation="sigmoid")(h), "aux": keras.layers.Dense(1)(h)}
    model = keras.Model(inputs=num, outputs=outputs)
    df = frame.withColumn("target", frame["y"] * 3.0)
    keras.utils.set_random_seed(3)
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=model, optimizer="adam",
        loss={"prob": "binary_crossentropy", "aux": "mse"}, feature_cols=["num"],
        label_cols={"prob": "y", "aux": "target"}, batch_size=64, epochs=1, verbose=0,
    )  # fmt: skip
    fitted = est.fit(df)
    assert fitted.getLabelCols() == ["target", "y"]  # the model's (sorted-key) order: aux, prob
    out = fitted.transform(df).select("num", "y__output", "target__output").toPandas()
    expected = fitted.getModel().predict(np.stack(out["num"].to_numpy()).astype("float32"), verbose=0)
    np.testing.assert_allclose(out["y__output"].to_numpy(), expected["prob"].ravel(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["target__output"].to_numpy(), expected["aux"].ravel(), rtol=1e-4, atol=1e-5)
