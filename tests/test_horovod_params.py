"""horovod.spark's KerasEstimator params with their meanings here: transformation_fn, reader threads,
the in-memory cache, the prefetch size, partitions_per_process, label_shapes; what is refused and why.
Real Spark, real ranks; what the ranks read is checked through HVD_SPARK_DATA_TRACE."""

import json
import os
import sys

import keras
import numpy as np
import pytest
from _helpers import xor_estimator, xor_frame

from hvd_spark import RankFailedError


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _sevens(frame):
    """A transformation_fn: every feature row becomes [7, 7] (the label stays)."""
    frame["x"] = [np.array([7.0, 7.0], dtype=np.float32)] * len(frame)
    return frame


def _traced(folder) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                r = json.loads(line)
                out.setdefault(r["epoch"], []).extend(r["ids"])
    return out


def test_transformation_reader_threads_cache_and_prefetch(spark, tmp_path):
    trace = tmp_path / "trace"
    df = xor_frame(spark, 400)
    est = xor_estimator(
        tmp_path / "store",
        epochs=2,
        batch_size=16,
        transformation_fn=_sevens,
        train_reader_num_workers=3,
        inmemory_cache_all=True,
        tensorflow_dataset_prefetch_buffer_size=2,
        shuffle_buffer_size=64,
        partitions_per_process=3,
        backend_env={"HVD_SPARK_DATA_TRACE": str(trace)},
        verbose=0,
    )
    model = est.fit(df)
    seen = _traced(trace)
    assert sorted(seen) == [0, 1]
    for ids in seen.values():
        assert len(ids) == 400 and set(ids) == {7.0}  # every row of every epoch, transformed
    files = [f for _, _, fs in os.walk(tmp_path / "store" / "data") for f in fs if f.endswith(".parquet")]
    assert len(files) == 2 * 3  # partitions_per_process files per rank
    assert len(model.getHistory()["loss"]) == 2


def _drop_half(frame):
    return frame.iloc[: len(frame) // 2]


def test_a_transformation_that_drops_rows_fails_naming_it(spark, tmp_path):
    est = xor_estimator(tmp_path / "store", epochs=1, transformation_fn=_drop_half, verbose=0)
    with pytest.raises(RankFailedError, match="transformation_fn must return a pandas DataFrame with the"):
        est.fit(xor_frame(spark, 64))


@pytest.mark.parametrize(
    "params,exc,match",
    [
        (dict(reader_pool_type="process"), ValueError, "reader_pool_type='process' is not supported"),
        (dict(data_module=object()), ValueError, "data_module is not supported: .*NVTabular"),
        (dict(continuous_cols=["a"]), ValueError, "continuous_cols is not supported"),
        (dict(label_shapes=[[2, 2]]), ValueError, r"label_shapes: \[2, 2\] holds 4 values; output"),
        (dict(label_shapes=[[1], [1]]), ValueError, "label_shapes must give one shape per label column"),
        (dict(checkpoint_callback=keras.callbacks.EarlyStopping()), TypeError, "ModelCheckpoint"),
        (dict(mp_start_method="thread"), ValueError, "mp_start_method must be one of"),
    ],
)
def test_horovod_params_refused_before_any_work(spark, tmp_path, params, exc, match):
    with pytest.raises(exc, match=match):
        xor_estimator(tmp_path / "store", **params).fit(xor_frame(spark, 16))
    assert not (tmp_path / "store" / "data").exists()


def test_label_shapes_reshape_labels(spark, tmp_path):
    """A 4-value array label for an output of shape (2, 2): label_shapes gives the labels that shape."""
    import pandas as pd

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(64, 2)).astype("float32")
    y = np.stack([x[:, 0], x[:, 1], -x[:, 0], -x[:, 1]], axis=1)
    df = spark.createDataFrame(pd.DataFrame({"x": list(x), "y": list(y)}))
    inp = keras.Input((2,))
    out = keras.layers.Reshape((2, 2))(keras.layers.Dense(4)(inp))
    est = xor_estimator(
        tmp_path / "store", model=keras.Model(inp, out), loss="mse", label_shapes=[[2, 2]], epochs=2, verbose=0
    )
    model = est.fit(df)
    assert model.getHistory()["loss"][-1] < model.getHistory()["loss"][0]


def test_a_vector_label_gives_vector_predictions_and_null_for_kept_invalid_rows(spark, tmp_path):
    """horovod.spark's output type: a Vector label's prediction column is a DenseVector; a row kept without
    a prediction (handleInvalid='keep') has a null there, not an error or a zero vector."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.ml.linalg import DenseVector
    from pyspark.sql import functions as F

    df = xor_frame(spark, 64).withColumn("yv", array_to_vector(F.array(F.col("y").cast("double"), F.lit(1.0))))
    inp = keras.Input((2,))
    est = xor_estimator(
        tmp_path / "store", model=keras.Model(inp, keras.layers.Dense(2)(inp)), loss="mse", label_cols=["yv"], epochs=1
    )
    model = est.fit(df).setHandleInvalid("keep")
    holes = spark.createDataFrame([([0.5, 0.5],), (None,)], "x array<float>")
    rows = model.transform(holes).collect()
    assert isinstance(rows[0]["yv__output"], DenseVector) and len(rows[0]["yv__output"]) == 2
    assert rows[1]["yv__output"] is None
