"""Any legal Spark column name works for features, labels, sample weights, validation and outputs.

Names as pandas and scikit-learn make them (keywords, spaces, slashes, dots, leading underscores,
backticks) used to break fit after the data was written (Petastorm's namedtuples) or on the driver
(a dotted name read as a struct field). Real Spark, 2 Horovod ranks over Gloo, real Parquet.
"""

import keras
import numpy as np
import pandas as pd
import pytest

from hvd_spark import HorovodEstimator
from hvd_spark._internal.common.specs import with_stored_names
from hvd_spark._internal.data import materialize as data_mod
from hvd_spark._internal.data.stats import column_stats

NAMES = ["class", "wine features", "class label", "od280/od315", "_features", "x.y", "a`b", "über", "1st", "__x__"]


def _frame(spark, names, n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 2)).astype("float32")
    y = ((x[:, 0] * x[:, 1]) > 0).astype("int64")
    cols = {
        names["features"]: list(x),
        names["scalar"]: x[:, 0].astype("float64"),
        names["label"]: y,
        names["weight"]: np.ones(n),
        names["validation"]: (np.arange(n) % 5 == 0).astype("int64"),
    }
    return spark.createDataFrame(pd.DataFrame(cols)).repartition(2)


def test_stored_names_are_identifiers_and_shared():
    from hvd_spark._internal.common.specs import ColumnInfo

    f = [ColumnInfo(n, "scalar", "double", False) for n in NAMES]
    (features, labels, weights) = with_stored_names(f, [f[0]], [None])
    assert [i.stored for i in features] == [f"c{i}" for i in range(len(NAMES))]
    assert labels[0].stored == "c0" and weights == [None]  # one column used twice: one stored name
    assert all(i.stored.isidentifier() for i in features)


def test_prepare_and_stats_accept_every_name(spark):
    rows = [tuple([float(i)] * len(NAMES)) for i in range(6)]
    df = spark.createDataFrame(rows, [*NAMES])
    infos = [data_mod.column_info(df, n, "feature") for n in NAMES]
    (infos,) = with_stored_names(infos)
    prepared = data_mod.prepare(df, infos, [], None, None, seed=0)
    assert prepared.columns == [i.stored for i in infos] + [data_mod.VAL_COL]
    stats = column_stats(prepared, infos, None)
    assert stats["rows"] == 6 and set(stats["columns"]) == set(NAMES)
    assert sorted(prepared.toPandas()["c5"]) == [float(i) for i in range(6)]  # 'x.y' read as itself


@pytest.mark.parametrize(
    "names",
    [
        dict(
            features="wine features",
            scalar="od280/od315",
            label="class",
            weight="x.y",
            validation="_is val",
            output="pred.class",
        ),
        dict(
            features="_features",
            scalar="a`b",
            label="class label",
            weight="1st",
            validation="x.y.z",
            output="my output",
        ),
    ],
    ids=["keywords-spaces-slashes-dots", "underscores-backticks"],
)
def test_fit_and_transform_with_awkward_names(spark, tmp_path, names):
    df = _frame(spark, names).cache()
    a = keras.Input(shape=(2,), name="a")
    b = keras.Input(shape=(1,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid")(h))
    est = HorovodEstimator(
        num_proc=2,
        store=str(tmp_path),
        model=model,
        optimizer=keras.optimizers.Adam(0.01),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        feature_cols=[names["features"], names["scalar"]],
        label_cols=[names["label"]],
        sample_weight_col=names["weight"],
        validation=names["validation"],
        output_cols=[names["output"]],
        batch_size=16,
        epochs=2,
    )
    fitted = est.fit(df)
    history = fitted.getHistory()
    assert len(history["loss"]) == 2 and len(history["val_loss"]) == 2
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1

    out = fitted.transform(df)
    # binary_crossentropy on one unit: a classifier, with Spark ML's columns after the output.
    assert out.columns == df.columns + [names["output"], "prediction", "probability", "rawPrediction"]
    pdf = out.toPandas()
    x = np.stack(pdf[names["features"]].to_numpy()).astype("float32")
    s = pdf[names["scalar"]].to_numpy().astype("float32").reshape(-1, 1)
    expected = fitted.getModel().predict([x, s], verbose=0)[:, 0]
    np.testing.assert_allclose(pdf[names["output"]].to_numpy(), expected, atol=1e-5)
