"""Integers wider than int32 and infinite values, end to end on both data paths (the copy,
materialize="always", and the table read in place, "never") and in transform. Real Spark (the shared
local[2] session), real ranks over Gloo, real Parquet.

* Hashed ids >= 2**31 in an ``array<bigint>`` column, or in ``bigint`` scalar columns stacked into
  one input, train an int64 model input (IntegerLookup + Embedding) to accuracy 1, and transform
  predicts them: no path casts them to int32 (Spark 4 refused that cast, Spark 3.5 and the ranks
  wrapped it).
* The same ids for an int32 model input are refused before any work, naming the column and a value;
  in transform, the UDF refuses them too.
* +-Inf in a feature (scalar, array, Vector), a label or a sample weight is refused before any work
  with nulls and NaNs (it trained to a NaN model)."""

import os

import keras
import numpy as np
import pytest
from _helpers import UDF_KINDS

from hvd_spark import HorovodEstimator, TFTransformer
from hvd_spark._internal.common.specs import specs_to_dicts
from hvd_spark._internal.ml.model_info import model_specs

VOCAB = [2**31 + 75_665 + 1_000_003 * k for k in range(6)] + [2**40 + 1, 2**62 + 3]  # all beyond int32
POSITIVE = set(VOCAB[::2])
INF = float("inf")


@pytest.fixture(scope="module")
def id_table(spark, tmp_path_factory):
    """256 rows written as Parquet: ``ids`` (two ids of VOCAB, array<bigint>), the same ids as the
    ``bigint`` columns ``a`` and ``b``, and ``y``: 1 when the first id is a POSITIVE one."""
    import pandas as pd

    rng = np.random.default_rng(0)
    ids = rng.choice(np.array(VOCAB, dtype=np.int64), size=(256, 2))
    y = np.array([int(i in POSITIVE) for i in ids[:, 0]], dtype=np.int64)
    pdf = pd.DataFrame({"ids": list(ids), "a": ids[:, 0], "b": ids[:, 1], "y": y})
    path = str(tmp_path_factory.mktemp("wide_ints") / "ids")
    schema = "ids array<bigint>, a bigint, b bigint, y bigint"
    spark.createDataFrame(pdf, schema).repartition(2).write.parquet(path)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("wide_ints_store"))


def _id_model(dtype="int64"):
    inputs = keras.Input(shape=(2,), dtype=dtype, name="ids")
    if dtype == "int64":
        index = keras.layers.IntegerLookup(vocabulary=np.array(VOCAB, dtype="int64"))(inputs)
        vectors = keras.layers.Embedding(len(VOCAB) + 1, 4)(index)
    else:
        vectors = keras.layers.Embedding(16, 4)(inputs)
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(vectors))
    return keras.Model(inputs, out)


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs] if os.path.exists(root) else []


def _estimator(store, model, features, materialize, **params):
    kw = dict(
        num_proc=2,
        store=store,
        model=model,
        optimizer=keras.optimizers.Adam(0.05),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        feature_cols=features,
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        materialize=materialize,
        verbose=0,
    )
    kw.update(params)
    return HorovodEstimator(**kw)


@pytest.mark.parametrize("materialize", ["always", "never"])
@pytest.mark.parametrize("features", [["ids"], ["a", "b"]], ids=["array", "stacked"])
def test_ids_beyond_int32_train_an_int64_input_and_are_predicted(spark, id_table, store, features, materialize):
    df = spark.read.parquet(id_table)
    fitted = _estimator(store, _id_model(), features, materialize).fit(df)
    assert fitted.getHistory()["accuracy"][-1] >= 0.95, fitted.getHistory()
    rows = fitted.transform(df).select("y", "y__output").collect()
    correct = sum(int(r["y__output"] > 0.5) == r["y"] for r in rows)
    assert correct >= 0.95 * len(rows), (correct, len(rows))


@pytest.mark.parametrize("materialize", ["always", "never"])
def test_ids_beyond_int32_for_an_int32_input_are_refused_before_any_work(spark, id_table, tmp_path, materialize):
    store = str(tmp_path / "store")
    est = _estimator(store, _id_model("int32"), ["ids"], materialize)
    with pytest.raises(
        ValueError,
        match=r"Feature column 'ids' holds values from \d+ to \d+; model input 'ids' takes int32, and "
        rf"{max(VOCAB)} is beyond int32's range \[-2147483648, 2147483647\]\. .*dtype='int64'",
    ):
        est.fit(spark.read.parquet(id_table))
    assert _files(store) == []


@pytest.mark.parametrize("udf", UDF_KINDS)
def test_transform_refuses_ids_an_int32_input_cannot_hold(spark, tmp_path, udf):
    model = _id_model("int32")
    path = str(tmp_path / "int32.keras")
    model.save(path)
    inputs, outputs = model_specs(model)
    t = TFTransformer(
        model_url="file://" + path,
        feature_cols=["ids"],
        output_cols=["o"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
        inference_udf=udf,
    )
    df = spark.createDataFrame([([1, 2],), ([3, VOCAB[0]],)], "ids array<bigint>")
    with pytest.raises(
        Exception, match=rf"Feature column 'ids' does not fit model input 'ids'.*{VOCAB[0]}, beyond int32"
    ):
        t.transform(df).collect()


@pytest.fixture(scope="module")
def inf_table(spark, tmp_path_factory):
    """16 rows with infinities: ``s`` (a scalar, 2 rows), ``arr`` (an array, 3 rows), ``vec`` (a Vector,
    1 row), the label ``yinf`` (1 row) and the weight ``w`` (1 row); ``ok``, ``y`` are finite."""
    import pandas as pd
    from pyspark.ml.functions import array_to_vector

    n = 16
    s = np.linspace(-1, 1, n)
    s[[2, 9]] = [INF, -INF]
    arr = [[0.1 * i, 1.0] for i in range(n)]
    for i in (1, 5, 11):
        arr[i] = [INF if i % 2 else -INF, 0.5]
    vec = [[0.5, 0.1 * i] for i in range(n)]
    vec[7] = [0.5, -INF]
    yinf = np.arange(n) % 2 * 1.0
    yinf[4] = INF
    w = np.ones(n)
    w[13] = INF
    pdf = pd.DataFrame(
        {"s": s, "arr": arr, "vec": vec, "ok": [[0.1, 0.2]] * n, "y": np.arange(n) % 2, "yinf": yinf, "w": w}
    )
    schema = "s double, arr array<double>, vec array<double>, ok array<double>, y bigint, yinf double, w double"
    df = spark.createDataFrame(pdf, schema).withColumn("vec", array_to_vector("vec"))
    path = str(tmp_path_factory.mktemp("infinities") / "t")
    df.repartition(2).write.parquet(path)
    return path


INF_CASES = [
    (dict(feature_cols=["s"]), 1, r"Feature column 's' has 2 of 16 rows with null, NaN or infinite values"),
    (dict(feature_cols=["arr"]), 2, r"Feature column 'arr' has 3 of 16 rows with null, NaN or infinite values"),
    (dict(feature_cols=["vec"]), 2, r"Feature column 'vec' has 1 of 16 rows with null, NaN or infinite values"),
    (dict(label_cols=["yinf"]), 2, r"Label column 'yinf' has 1 of 16 rows with null, NaN or infinite values"),
    (dict(sample_weight_col="w"), 2, r"Sample weight column 'w' has 1 of 16 rows with null, NaN or infinite values"),
]


@pytest.mark.parametrize("materialize", ["always", "never"])
@pytest.mark.parametrize("override,width,match", INF_CASES, ids=["scalar", "array", "vector", "label", "weight"])
def test_infinities_are_refused_before_any_work(spark, inf_table, tmp_path, materialize, override, width, match):
    store = str(tmp_path / "store")
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(1, activation="sigmoid")])
    kw = {"feature_cols": ["ok"], "label_cols": ["y"], **override}
    est = _estimator(store, model, kw.pop("feature_cols"), materialize, **kw)
    with pytest.raises(ValueError, match=match):
        est.fit(spark.read.parquet(inf_table))
    assert _files(store) == []
