"""Nulls and NaNs at transform, with transformers built on small saved models (no fit).

The rule, the same on the Arrow and the pandas UDF: a null feature, or an array feature holding a
null element, makes the row invalid (handled as ``handleInvalid`` says); a NaN is a value and goes
to the model; a NaN output stays NaN in the output column and never becomes a class (the
classifier columns are null)."""

import math

import numpy as np
import pytest
from _helpers import UDF_KINDS

from hvd_spark import TFTransformer
from hvd_spark._internal.common.specs import specs_to_dicts
from hvd_spark._internal.ml.model_info import model_specs


def _linear(path, width_in: int, kernel) -> str:
    """A saved model ``x @ kernel`` (no bias): a NaN anywhere in a row makes its outputs NaN."""
    import keras

    inputs = keras.Input(shape=(width_in,))
    dense = keras.layers.Dense(len(kernel[0]), use_bias=False)
    model = keras.Model(inputs, dense(inputs))
    dense.set_weights([np.asarray(kernel, dtype="float32")])
    model.save(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan_models")
    out = {}
    for name, width, kernel in [("sum2", 2, [[1.0], [1.0]]), ("id1", 1, [[1.0]]), ("three", 1, [[1.0, 2.0, 3.0]])]:
        path = str(folder / f"{name}.keras")
        out[name] = (path, _linear(path, width, kernel))
    return out


def _transformer(models, name, udf, **params):
    path, model = models[name]
    inputs, outputs = model_specs(model)
    return TFTransformer(
        model_url="file://" + path,
        feature_cols=params.pop("feature_cols", ["x"]),
        output_cols=["o"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
        inference_udf=udf,
        **params,
    )


def _by_id(df):
    return {r["id"]: r for r in df.collect()}


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_null_elements_make_a_row_invalid_under_every_handle_invalid(spark, models, udf):
    rows = [(0, [1.0, 2.0]), (1, [1.0, None]), (2, None), (3, [float("nan"), 1.0])]
    df = spark.createDataFrame(rows, "id int, x array<double>").coalesce(1)
    t = _transformer(models, "sum2", udf)
    holed = df.where("id in (0, 1)")
    with pytest.raises(Exception, match=r"Feature column 'x' has 1 rows with null elements in a batch of 2 rows"):
        t.transform(holed).collect()
    kept = _by_id(t.copy({t.handleInvalid: "keep"}).transform(df))
    assert kept[0]["o"] == pytest.approx(3.0)
    assert kept[1]["o"] is None and kept[2]["o"] is None  # null elements as a null array: no prediction
    assert math.isnan(kept[3]["o"])  # a NaN value went to the model, which gave NaN
    assert sorted(_by_id(t.copy({t.handleInvalid: "skip"}).transform(df))) == [0, 3]


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_scalar_nan_feature_is_a_value_on_both_paths(spark, models, udf):
    df = spark.createDataFrame([(0, 0.7), (1, float("nan"))], "id int, x double").coalesce(1)
    t = _transformer(models, "id1", udf)
    got = _by_id(t.transform(df))  # handleInvalid="error": a NaN is not a null
    assert got[0]["o"] == pytest.approx(0.7) and math.isnan(got[1]["o"])
    with_null = spark.createDataFrame([(0, 0.7), (1, float("nan")), (2, None)], "id int, x double").coalesce(1)
    with pytest.raises(Exception, match=r"Feature column 'x' has 1 null values in a batch of 3 rows"):
        t.transform(with_null).collect()
    kept = _by_id(t.copy({t.handleInvalid: "keep"}).transform(with_null))
    assert math.isnan(kept[1]["o"]) and kept[2]["o"] is None
    assert sorted(_by_id(t.copy({t.handleInvalid: "skip"}).transform(with_null))) == [0, 1]


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_output_of_a_binary_classifier_is_no_class(spark, models, udf):
    df = spark.createDataFrame([(0, 0.7), (1, float("nan")), (2, 0.2)], "id int, x double").coalesce(1)
    got = _by_id(_transformer(models, "id1", udf, task="binary").transform(df))
    assert (got[0]["prediction"], got[2]["prediction"]) == (1.0, 0.0)
    assert math.isnan(got[1]["o"])
    assert (got[1]["prediction"], got[1]["probability"], got[1]["rawPrediction"]) == (None, None, None)


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_output_of_a_multiclass_classifier_is_no_class(spark, models, udf):
    df = spark.createDataFrame([(0, 1.0), (1, float("nan")), (2, -1.0)], "id int, x double").coalesce(1)
    got = _by_id(_transformer(models, "three", udf, task="multiclass").transform(df))
    assert (got[0]["prediction"], got[2]["prediction"]) == (2.0, 0.0)
    assert all(math.isnan(v) for v in got[1]["o"])
    assert (got[1]["prediction"], got[1]["probability"], got[1]["rawPrediction"]) == (None, None, None)


def test_one_nan_among_class_scores_is_no_class(spark, models):
    """Spark's array_max orders NaN above every number: without the check, its index would be the class."""
    rows = [(0, [0.1, float("nan"), 0.2]), (1, [0.1, 0.7, 0.2])]
    df = spark.createDataFrame(rows, "id int, o array<double>")
    for logits in (False, True):
        t = TFTransformer(
            model_url="file:///unused.keras",
            feature_cols=["x"],
            output_cols=["o"],
            task="multiclass",
            from_logits=logits,
        )
        got = _by_id(t._with_classifier_cols(df, "o"))
        assert got[0]["prediction"] is None and got[0]["probability"] is None
        assert got[1]["prediction"] == 1.0
