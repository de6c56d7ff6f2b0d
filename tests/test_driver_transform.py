"""``transform`` of a small DataFrame made on the driver (a local relation) or in a filled cache is
predicted by the driver (``ml/driver_transform.py``): no Python UDF in its plan, and the same rows,
columns, types and values as the UDF gives (``HVD_SPARK_DRIVER_TRANSFORM_ROWS=0``), under every
``handleInvalid``. Transformers are built on a small saved model (no fit); real Spark."""

import datetime
import math

import numpy as np
import pandas as pd
import pytest

from hvd_spark import TFTransformer
from hvd_spark._internal.common.specs import specs_to_dicts
from hvd_spark._internal.ml.driver_transform import driver_rows
from hvd_spark._internal.ml.model_info import model_specs
from hvd_spark.errors import InvalidFeatureError


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """A saved model: x (4 values) and s (1 value) in; a regression and a 3-class softmax out."""
    import keras

    keras.utils.set_random_seed(3)
    x, s = keras.Input((4,), name="x"), keras.Input((1,), name="s")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([x, s]))
    model = keras.Model(
        [x, s], [keras.layers.Dense(1, name="reg")(h), keras.layers.Dense(3, activation="softmax", name="cls")(h)]
    )
    path = str(tmp_path_factory.mktemp("driver_transform") / "two.keras")
    model.save(path)
    return path, model


def _transformer(two_outputs, **params):
    path, model = two_outputs
    inputs, outputs = model_specs(model)
    return TFTransformer(
        model_url="file://" + path,
        feature_cols=["x", "s"],
        output_cols=["reg_out", "cls_out"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
        **params,
    )


def _frame(spark, bad: bool):
    rng = np.random.default_rng(0)
    n = 40
    x = [list(map(float, v)) for v in rng.normal(size=(n, 4))]
    s = rng.normal(size=n)
    if bad:
        x[3] = None
        x[5][2] = float("nan")
        s[7] = np.inf
    when = [datetime.datetime(2026, 1, 1) + datetime.timedelta(hours=i) for i in range(n)]
    frame = pd.DataFrame({"id": range(n), "x": x, "s": s, "tag": [f"t{i % 3}" for i in range(n)], "when": when})
    return spark.createDataFrame(frame)


def _rows(df):
    def plain(v):
        return [plain(e) for e in v] if isinstance(v, (list, tuple)) else v

    return {r["id"]: {k: plain(v) for k, v in r.asDict().items()} for r in df.collect()}


def _same(a, b):
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
    return a == b


def _by_udf(spark, transformer, df):
    spark.conf.set("spark.hvd_spark.driverTransformRows", "0")
    try:
        out = transformer.transform(df)
        return out, _rows(out)
    finally:
        spark.conf.unset("spark.hvd_spark.driverTransformRows")


@pytest.mark.parametrize("invalid", ["keep", "skip"])
def test_the_driver_predicts_what_the_udf_predicts(spark, two_outputs, invalid):
    df = _frame(spark, bad=True)
    t = _transformer(two_outputs, handleInvalid=invalid)
    assert driver_rows(df) == 40
    ours = t.transform(df)
    plan = ours._jdf.queryExecution().executedPlan().toString()
    assert "EvalPython" not in plan and "LocalTableScan" in plan  # no UDF: a local relation again
    udf_df, theirs = _by_udf(spark, t, df)
    assert "EvalPython" in udf_df._jdf.queryExecution().executedPlan().toString()
    assert ours.schema == udf_df.schema
    mine = _rows(ours)
    assert mine.keys() == theirs.keys() == (set(range(40)) - ({3, 5, 7} if invalid == "skip" else set()))
    for i, row in theirs.items():
        assert all(_same(mine[i][k], v) for k, v in row.items()), (i, mine[i], row)
    if invalid == "keep":
        assert mine[3]["reg_out"] is None and mine[5]["cls_out"] is None and mine[7]["reg_out"] is None
    assert len(mine[0]["cls_out"]) == 3 and math.isclose(sum(mine[0]["cls_out"]), 1.0, rel_tol=1e-5)


def test_an_invalid_row_is_refused_by_transform_itself(spark, two_outputs):
    df = _frame(spark, bad=True)
    with pytest.raises(InvalidFeatureError, match="'x'"):
        _transformer(two_outputs).transform(df)


def test_only_small_frames_made_on_the_driver_and_auto_udf(spark, two_outputs):
    df = _frame(spark, bad=False)
    assert driver_rows(df.repartition(2)) is None  # a shuffle: the UDF predicts
    assert driver_rows(spark.range(3)) is None
    spark.conf.set("spark.hvd_spark.driverTransformRows", "39")
    try:
        assert driver_rows(df) is None  # more rows than the bound
    finally:
        spark.conf.unset("spark.hvd_spark.driverTransformRows")
    named = _transformer(two_outputs, inference_udf="pandas").transform(df)  # a UDF asked for by name
    assert "EvalPython" in named._jdf.queryExecution().executedPlan().toString()


def test_a_filled_cache_is_predicted_by_the_driver(spark, two_outputs):
    """A cached frame (a CrossValidator's fold) once an action filled its cache: its rows and size are
    exact then. Not before, nor when the cache is larger than HVD_SPARK_LOCAL_COPY_BYTES."""
    df = _frame(spark, bad=False).repartition(2).cache()
    try:
        t = _transformer(two_outputs)
        assert driver_rows(df) is None  # not filled: its size is an estimate
        assert df.count() == 40
        assert driver_rows(df) == 40
        ours = t.transform(df)
        assert "EvalPython" not in ours._jdf.queryExecution().executedPlan().toString()
        udf_df, theirs = _by_udf(spark, t, df)
        assert ours.schema == udf_df.schema
        mine = _rows(ours)
        assert mine.keys() == theirs.keys() == set(range(40))
        for i, row in theirs.items():
            assert all(_same(mine[i][k], v) for k, v in row.items()), (i, mine[i], row)
        assert driver_rows(df.select("id", "x", "s")) is None  # a plan over the cache: the UDF predicts
        spark.conf.set("spark.hvd_spark.localCopyBytes", "100")
        try:
            assert driver_rows(df) is None  # a cache larger than the bound
        finally:
            spark.conf.unset("spark.hvd_spark.localCopyBytes")
    finally:
        df.unpersist()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A saved 3-class softmax model on one array input of 4 values."""
    import keras

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    path = str(tmp_path_factory.mktemp("driver_transform") / "cls.keras")
    model.save(path)
    return path, model


def test_a_classifier_with_its_spark_columns(spark, classifier):
    path, model = classifier
    inputs, outputs = model_specs(model)
    t = TFTransformer(
        model_url="file://" + path,
        feature_cols=["x"],
        output_cols=["probs"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
        task="multiclass",
    )
    df = _frame(spark, bad=False)
    ours = t.transform(df)
    assert "EvalPython" not in ours._jdf.queryExecution().executedPlan().toString()
    udf_df, theirs = _by_udf(spark, t, df)
    assert ours.schema == udf_df.schema and {"prediction", "probability"} <= set(ours.columns)
    mine = _rows(ours)
    for i, row in theirs.items():
        assert all(_same(mine[i][k], v) for k, v in row.items()), (i, mine[i], row)
    assert {r["prediction"] for r in mine.values()} <= {0.0, 1.0, 2.0}
