"""Nulls, NaNs and infinities at transform, with transformers built on small saved models (no fit).

The rule, the same on the Arrow and the pandas UDF: a null feature, an array feature holding a null
element, or a NaN or an infinity in a feature makes the row invalid (handled as ``handleInvalid``
says; fit refuses them too); a NaN output stays NaN in the output column and never becomes a class
(the classifier columns are null). A refused batch's error is the first line after Spark's prefix."""

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


def _nan_above(path, kernel) -> str:
    """A saved model ``x @ kernel``, whose outputs are NaN for x of 3.5 or more: it adds
    ``1e38 x - 1e38 x``, which is 0 below and ``inf - inf`` above float32's range."""
    import keras

    inputs = keras.Input(shape=(1,))
    main = keras.layers.Dense(len(kernel[0]), use_bias=False)
    spread = keras.layers.Dense(2, use_bias=False)
    back = keras.layers.Dense(len(kernel[0]), use_bias=False)
    model = keras.Model(inputs, keras.layers.Add()([main(inputs), back(spread(inputs))]))
    main.set_weights([np.asarray(kernel, dtype="float32")])
    spread.set_weights([np.asarray([[1e38, -1e38]], dtype="float32")])
    back.set_weights([np.ones((2, len(kernel[0])), dtype="float32")])
    model.save(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan_models")
    out = {}
    for name, width, kernel in [("sum2", 2, [[1.0], [1.0]]), ("id1", 1, [[1.0]])]:
        path = str(folder / f"{name}.keras")
        out[name] = (path, _linear(path, width, kernel))
    for name, kernel in [("id1_nan", [[1.0]]), ("three_nan", [[1.0, 2.0, 3.0]])]:
        path = str(folder / f"{name}.keras")
        out[name] = (path, _nan_above(path, kernel))
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
    rows = [(0, [1.0, 2.0]), (1, [1.0, None]), (2, None), (3, [float("nan"), 1.0]), (4, [1.0, float("-inf")])]
    df = spark.createDataFrame(rows, "id int, x array<double>").coalesce(1)
    t = _transformer(models, "sum2", udf)
    holed = df.where("id in (0, 1)")
    with pytest.raises(Exception, match=r"Feature column 'x' has 1 rows with null elements in a batch of 2 rows"):
        t.transform(holed).collect()
    nonfinite = df.where("id in (0, 3, 4)")
    with pytest.raises(Exception, match=r"Feature column 'x' has 2 rows with NaN or infinite values in a batch of 3"):
        t.transform(nonfinite).collect()
    kept = _by_id(t.copy({t.handleInvalid: "keep"}).transform(df))
    assert kept[0]["o"] == pytest.approx(3.0)
    assert kept[1]["o"] is None and kept[2]["o"] is None  # null elements as a null array: no prediction
    assert kept[3]["o"] is None and kept[4]["o"] is None  # a NaN or an infinity: no prediction either
    assert sorted(_by_id(t.copy({t.handleInvalid: "skip"}).transform(df))) == [0]


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_or_infinite_scalar_feature_follows_handle_invalid_like_a_null(spark, models, udf):
    rows = [(0, 0.7), (1, float("nan")), (2, None), (3, float("inf"))]
    df = spark.createDataFrame(rows, "id int, x double").coalesce(1)
    t = _transformer(models, "id1", udf)
    with pytest.raises(Exception, match=r"Feature column 'x' has 1 null values in a batch of 4 rows") as raised:
        t.transform(df).collect()
    with pytest.raises(Exception) as nan_raised:
        t.transform(df.where("id != 2")).collect()
    import pyspark

    lines = [str(e.value).splitlines() for e in (raised, nan_raised)]
    if int(pyspark.__version__.split(".")[0]) < 4:  # no SPARK_HIDE_TRACEBACK: a one-frame traceback first
        lines = [[ln[0], *[x for x in ln if x.startswith("hvd_spark.errors.")]] for ln in lines]
    # hvd_spark's message is the first line after Spark's prefix: no traceback before it (pyspark >= 4.0)
    assert lines[1][1] == (
        "hvd_spark.errors.InvalidFeatureError: Feature column 'x' has 2 rows with NaN or infinite values in a "
        "batch of 3 rows; transform() needs finite numbers, as fit does (handleInvalid='keep' gives such rows "
        "null predictions, 'skip' leaves them out)."
    ), lines[1][:3]
    assert lines[0][1].startswith("hvd_spark.errors.InvalidFeatureError: Feature column 'x' has 1 null values")
    # Only hvd_spark's error loses its traceback: a user's UDF failing later in the same (reused) worker
    # keeps its own (setting SPARK_HIDE_TRACEBACK in the worker hid it in tests/test_faults.py's UDF test).
    from pyspark.sql import functions as F

    @F.udf("double")
    def users_own(v):
        raise ArithmeticError("the user's own error")

    with pytest.raises(Exception) as users:
        df.select(users_own("x")).collect()
    assert "in users_own" in str(users.value) and "ArithmeticError: the user's own error" in str(users.value)
    kept = _by_id(t.copy({t.handleInvalid: "keep"}).transform(df))
    assert kept[0]["o"] == pytest.approx(0.7)
    assert kept[1]["o"] is None and kept[2]["o"] is None and kept[3]["o"] is None
    assert sorted(_by_id(t.copy({t.handleInvalid: "skip"}).transform(df))) == [0]


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_output_of_a_binary_classifier_is_no_class(spark, models, udf):
    df = spark.createDataFrame([(0, 0.7), (1, 10.0), (2, 0.2)], "id int, x double").coalesce(1)
    got = _by_id(_transformer(models, "id1_nan", udf, task="binary").transform(df))
    assert (got[0]["prediction"], got[2]["prediction"]) == (1.0, 0.0)
    assert math.isnan(got[1]["o"])
    assert (got[1]["prediction"], got[1]["probability"], got[1]["rawPrediction"]) == (None, None, None)


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_output_of_a_multiclass_classifier_is_no_class(spark, models, udf):
    df = spark.createDataFrame([(0, 1.0), (1, 10.0), (2, -1.0)], "id int, x double").coalesce(1)
    got = _by_id(_transformer(models, "three_nan", udf, task="multiclass").transform(df))
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


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_a_nan_in_a_vector_or_a_stacked_group_makes_its_row_invalid(spark, models, udf):
    from pyspark.ml.linalg import Vectors

    rows = [(0, Vectors.dense([1.0, 2.0]), 1.0, 2.0), (1, Vectors.dense([float("inf"), 1.0]), float("nan"), 1.0)]
    df = spark.createDataFrame(rows, ["id", "v", "a", "b"]).coalesce(1)
    for features in (["v"], ["a", "b"]):
        t = _transformer(models, "sum2", udf, feature_cols=features)
        with pytest.raises(Exception, match=r"has 1 rows with NaN or infinite values in a batch of 2 rows"):
            t.transform(df).collect()
        kept = _by_id(t.copy({t.handleInvalid: "keep"}).transform(df))
        assert kept[0]["o"] == pytest.approx(3.0) and kept[1]["o"] is None
        assert sorted(_by_id(t.copy({t.handleInvalid: "skip"}).transform(df))) == [0]
