"""Bad input fails before any work, with a message naming the parameter or column, and leaves the store empty."""

import os
import threading

import keras
import pytest

from hvd_spark import HorovodEstimator
from hvd_spark._internal.rank.reader import petastorm_available


@pytest.fixture(scope="module")
def df(spark):
    rows = [
        (
            [0.1 * i, 0.2],
            i % 2,
            "s",
            [1.0] * (1 + i % 2),
            [1.0, 2.0, 3.0],
            [float("nan") if i == 3 else 0.5, 0.5],
            None if i == 5 else i % 2,
            False,
            1.0,
            i % 3,
        )
        for i in range(8)
    ]
    schema = (
        "x array<float>, y long, s string, rag array<double>, x3 array<double>, xnan array<double>, "
        "ynull long, v0 boolean, w double, y3 int"
    )
    return spark.createDataFrame(rows, schema).cache()


def _model(compiled=True):
    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid")])
    if compiled:
        m.compile(optimizer="sgd", loss="binary_crossentropy")
    return m


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs] if os.path.exists(root) else []


CASES = [
    (dict(feature_cols=["nope"]), ValueError, r"feature column 'nope' is not in the DataFrame"),
    (dict(label_cols=["missing_label"]), ValueError, r"label column 'missing_label' is not in the DataFrame"),
    (dict(feature_cols=["s"]), ValueError, r"Feature column 's' holds strings; model input .* takes float32"),
    (dict(label_cols=["s"]), TypeError, r"label column 's' has type string\. Expected a numeric column.*StringIndexer"),
    (dict(feature_cols=["rag"]), ValueError, r"Column 'rag' has ragged arrays: rows have between 1 and 2 values"),
    (
        dict(feature_cols=["x3"]),
        ValueError,
        r"Model input .* expects 2 values per row .*column 'x3' has rows of "
        r"length 3",
    ),
    (dict(label_cols=["x3"]), ValueError, r"label column 'x3' has 3 values per row\. Expected 1"),
    (dict(feature_cols=["xnan"]), ValueError, r"Feature column 'xnan' has 1 of 8 rows with null, NaN or infinite"),
    (dict(label_cols=["ynull"]), ValueError, r"Label column 'ynull' has 1 of 8 rows with null, NaN or infinite"),
    (dict(model="uncompiled"), ValueError, r"The model is not compiled, so optimizer and loss are required"),
    (dict(num_proc=0), ValueError, r"num_proc must be at least 1"),
    (
        dict(num_proc=5),
        ValueError,
        r"num_proc must be at most the number of task slots \(2\) for a barrier stage\. Received: num_proc=5",
    ),
    (dict(start_timeout=0), ValueError, r"start_timeout must be greater than 0"),
    (dict(start_timeout="soon"), TypeError, r"start_timeout must be a number of seconds\. Received: 'soon'"),
    (dict(stall_timeout=2), ValueError, r"stall_timeout must be 0 \(no stall watchdog\) or at least 5 seconds"),
    (dict(stall_timeout="never"), TypeError, r"stall_timeout must be a number of seconds \(0: no stall watchdog\)"),
    (dict(callbacks="unpicklable"), TypeError, r"callbacks must be picklable with cloudpickle: every rank receives"),
    (dict(batch_size=0), ValueError, r"batch_size must be at least 1\. Received: batch_size=0"),
    (dict(epochs=0), ValueError, r"epochs must be at least 1"),
    (
        dict(validation=1.0),
        ValueError,
        r"validation must be a fraction in \[0, 1\) or a column name\. Received: "
        r"validation=1\.0",
    ),
    (dict(validation=-0.2), ValueError, r"validation must be a fraction in \[0, 1\)"),
    (dict(validation="no_such_col"), ValueError, r"validation column 'no_such_col' is not in the DataFrame"),
    (dict(validation="v0"), ValueError, r"The validation split is empty \(validation='v0' selected 0 of 8 rows\)"),
    (dict(validation=0.000001), ValueError, r"The validation split is empty"),
    (dict(validation="y3"), ValueError, r"validation column 'y3' has 2 rows that are null or not 0/1"),
    (dict(backend="nccl"), ValueError, r"backend must be 'gloo' or 'mpi'"),
    (
        dict(num_proc=None, min_num_proc=3, max_restarts=1),
        ValueError,
        r"min_num_proc=3 is more than the 2 task slots of master local\[2\], which never change",
    ),
    (dict(min_num_proc=2, max_num_proc=2), ValueError, r"need max_restarts >= 1"),
    (dict(checkpoint_every="often"), ValueError, r"checkpoint_every must be a number of steps"),
    (dict(run_id="../escape"), ValueError, r"run_id must be 1-128 letters"),
    (dict(feature_cols=["x", "y"]), ValueError, r"feature_cols must name one column per model input \(1"),
    (dict(sample_weight_col="x"), TypeError, r"sample weight column 'x' must be numeric"),
    (dict(model="not a model"), TypeError, r"model must be a keras.Model"),
    (dict(store=None), ValueError, r"store is required"),
    (
        dict(reader="parquet"),
        ValueError,
        r"reader must be one of \['arrow', 'petastorm'\]\. Received: "
        r"reader='parquet'",
    ),
]
if not petastorm_available():
    CASES.append((dict(reader="petastorm"), ValueError, r"reader='petastorm' needs Petastorm 0\.13\.1 with pyarrow 12"))


class _LockedCallback(keras.callbacks.Callback):
    """A callback holding a lock: cloudpickle cannot copy it to the ranks."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.parametrize("override,exc,match", CASES, ids=[str(c[0]) for c in CASES])
def test_bad_input_raises_before_any_work(df, tmp_path, override, exc, match):
    store = str(tmp_path / "store")
    kw = dict(num_proc=2, store=store, model=_model(), feature_cols=["x"], label_cols=["y"], batch_size=4)
    kw.update(override)
    if kw["model"] == "uncompiled":
        kw["model"] = _model(compiled=False)
    if kw.get("callbacks") == "unpicklable":
        kw["callbacks"] = [_LockedCallback()]
    with pytest.raises(exc, match=match):
        HorovodEstimator(**kw).fit(df)
    assert _files(store) == []


def test_empty_dataframe(df, tmp_path):
    store = str(tmp_path / "store")
    with pytest.raises(ValueError, match=r"The DataFrame passed to fit\(\) is empty: 0 rows"):
        HorovodEstimator(num_proc=2, store=store, model=_model(), feature_cols=["x"], label_cols=["y"]).fit(df.limit(0))
    assert _files(store) == []


def test_unwritable_store(df, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"store must be writable by hvd_spark\. Received: .*a_file/store"):
        HorovodEstimator(
            num_proc=2, store=str(blocker / "store"), model=_model(), feature_cols=["x"], label_cols=["y"]
        ).fit(df)


def test_a_pandas_frame_is_refused_with_the_conversion(tmp_path):
    """Issue 47.3: fit(pandas_df) failed with AttributeError: 'DataFrame' object has no attribute 'sparkSession'."""
    import pandas as pd

    est = HorovodEstimator(
        num_proc=1, store=str(tmp_path), model=_model(), feature_cols=["features"], label_cols=["label"]
    )
    with pytest.raises(
        TypeError, match=r"Spark DataFrame\. Received: a pandas\.core\.frame\.DataFrame\..*createDataFrame"
    ):
        est.fit(pd.DataFrame({"features": [[0.0, 1.0]], "label": [1.0]}))
    assert not any(tmp_path.iterdir())  # nothing written


def test_wrong_param_types_fail_at_construction():
    with pytest.raises(TypeError, match="feature_cols must be a column name, a list of column names or a dict"):
        HorovodEstimator(feature_cols=[1, 2])
    with pytest.raises(TypeError, match="Unknown HorovodEstimator parameters|unexpected keyword"):
        HorovodEstimator(num_processes=2)


def test_transform_refuses_existing_output_column(spark, tmp_path):
    from hvd_spark import TFTransformer

    t = TFTransformer(
        model_url="file:///nonexistent.keras",
        feature_cols=["x"],
        label_cols=["y"],
        input_specs=[{"name": "in", "shape": [2], "dtype": "float32"}],
        output_specs=[{"name": "out", "shape": [1], "dtype": "float32"}],
    )
    df = spark.createDataFrame([([1.0, 2.0], 0.0, 1.0)], "x array<double>, y double, y__output double")
    with pytest.raises(ValueError, match=r"Output columns \['y__output'\] already exist"):
        t.transform(df)


def test_transform_refuses_unknown_inference_udf(spark):
    from hvd_spark import TFTransformer

    kwargs = dict(
        model_url="file:///nonexistent.keras",
        feature_cols=["x"],
        label_cols=["y"],
        input_specs=[{"name": "in", "shape": [2], "dtype": "float32"}],
        output_specs=[{"name": "out", "shape": [1], "dtype": "float32"}],
    )
    expected = r"inference_udf must be 'auto', 'arrow' or 'pandas'\. Received: inference_udf='numpy'"
    with pytest.raises(ValueError, match=expected):  # at construction: the Param's converter
        TFTransformer(**kwargs, inference_udf="numpy")
    t = TFTransformer(**kwargs)
    with pytest.raises(ValueError, match=expected):
        t.setInferenceUdf("numpy")
    assert t.getOrDefault(t.inference_udf) == "auto"  # the refused value was not kept
