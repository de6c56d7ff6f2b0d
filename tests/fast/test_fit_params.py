"""The estimator's parameters as a typed record: every Param's converter refuses a wrong value when it
is set, naming the parameter and what it expects, and ``FitParams`` is what ``fit`` reads."""

import dataclasses
import pathlib

import pytest

from hvd_spark._internal.data.store import Store
from hvd_spark._internal.ml.backend import InProcessBackend
from hvd_spark._internal.ml.converters import CONVERTERS
from hvd_spark._internal.ml.fit_params import FitParams, is_backend_object


class _Model:  # what the converter recognizes a Keras model by (fit checks keras.Model itself)
    layers: list = []

    def get_weights(self):
        return []


class _Optimizer:
    def get_config(self):
        return {}


BAD = [
    ("num_proc", "2", TypeError, r"num_proc must be an integer or None\. Received: '2'"),
    ("num_proc", 0, ValueError, r"num_proc must be at least 1 \(or None\)\. Received: num_proc=0"),
    ("store", 3, TypeError, r"store must be a path, a URL or a hvd_spark\.Store\. Received: int"),
    ("model", "not a model", TypeError, r"model must be a keras\.Model"),
    ("optimizer", 0.1, TypeError, r"optimizer must be a Keras optimizer or its name"),
    ("learning_rate", -1, ValueError, r"learning_rate must be a positive number or None"),
    ("learning_rate", 0, ValueError, r"learning_rate must be a positive number or None\. Received: learning_rate=0"),
    ("loss", 3, TypeError, r"loss must be a loss name, function or keras\.losses\.Loss"),
    ("loss_weights", ["a"], TypeError, r"loss_weights must be a list of numbers or a dict"),
    ("metrics", "accuracy", TypeError, r"metrics must be a list of metrics"),
    ("custom_objects", ["f"], TypeError, r"custom_objects must be a dict of name -> class or function"),
    ("feature_cols", [1], TypeError, r"feature_cols must be a column name, a list of column names or a dict"),
    ("label_cols", [["a", 1]], TypeError, r"label_cols must be a column name.*stack into one output"),
    ("sample_weight_col", 1, TypeError, r"sample_weight_col must be a string or None"),
    ("validation", 1.0, ValueError, r"validation must be a fraction in \[0, 1\) or a column name"),
    ("validation", [0.1], TypeError, r"validation must be a fraction in \[0, 1\) or a column name"),
    ("callbacks", "cb", TypeError, r"callbacks must be a list of keras\.callbacks\.Callback"),
    ("batch_size", 0, ValueError, r"batch_size must be at least 1\. Received: batch_size=0"),
    ("batch_size", 3.5, ValueError, r"batch_size must be an integer\. Received: batch_size=3\.5"),
    ("batch_size", "32", TypeError, r"batch_size must be an integer\. Received: '32'"),
    ("epochs", True, TypeError, r"epochs must be an integer"),
    ("val_batch_size", 0, ValueError, r"val_batch_size must be at least 1 \(or None\)"),
    ("shuffle", 1, TypeError, r"shuffle must be True or False\. Received: 1"),
    ("random_seed", "7", TypeError, r"random_seed must be an integer"),
    ("run_id", 5, TypeError, r"run_id must be a string or None\. Received: 5 \(int\)"),
    ("run_id", "../escape", ValueError, r"run_id must be 1-128 letters"),
    ("verbose", 3, ValueError, r"verbose must be 0, 1 or 2\. Received: verbose=3"),
    ("backend", "nccl", ValueError, r"backend must be 'gloo' or 'mpi'\. Received: backend='nccl'"),
    ("backend", 2, TypeError, r"backend must be 'gloo', 'mpi' or an object with run\(fn, args, kwargs, env\)"),
    ("start_timeout", "soon", TypeError, r"start_timeout must be a number of seconds\. Received: 'soon'"),
    ("start_timeout", "30", TypeError, r"start_timeout must be a number of seconds\. Received: '30'"),
    ("start_timeout", 0, ValueError, r"start_timeout must be .*greater than 0"),
    ("stall_timeout", 2, ValueError, r"stall_timeout must be 0 \(no stall watchdog\) or at least 5 seconds"),
    ("stall_timeout", "never", TypeError, r"stall_timeout must be a number of seconds \(0: no stall watchdog\)"),
    ("use_gpu", 1, TypeError, r"use_gpu must be True, False or None\. Received: 1"),
    ("max_restarts", -1, ValueError, r"max_restarts must be at least 0"),
    ("backward_passes_per_step", 0, ValueError, r"backward_passes_per_step must be at least 1"),
    ("gradient_compression", "int8", ValueError, r"gradient_compression must be 'none' or 'fp16'\. Received: "),
    ("reader", "parquet", ValueError, r"reader must be one of \['arrow', 'petastorm'\]\. Received: reader='parquet'"),
    ("reuse_data", "sometimes", ValueError, r"reuse_data must be one of \['auto', 'always', 'never'\]"),
    ("task", "multiclass", ValueError, r"task must be one of \['auto', 'classification', 'regression'\]"),
    ("task", 1, TypeError, r"task must be one of"),
    ("mlflow", "yes", ValueError, r"mlflow must be 'auto', 'on' or 'off' \(or True / False\)"),
    ("mlflow", 2, TypeError, r"mlflow must be 'auto', 'on' or 'off' \(or True / False\)\. Received: 2 \(int\)"),
    ("min_num_proc", 0, ValueError, r"min_num_proc must be at least 1"),
    ("max_num_proc", 1.5, ValueError, r"max_num_proc must be an integer"),
    ("elastic_timeout", -1, ValueError, r"elastic_timeout must be .*greater than 0"),
    ("checkpoint_every", 0, ValueError, r"checkpoint_every must be a number of steps .* or a duration"),
    ("checkpoint_every", "often", ValueError, r"checkpoint_every must be .*Received: checkpoint_every='often'"),
    ("checkpoint_every", 2.5, ValueError, r"checkpoint_every must be a number of steps"),
    ("checkpoint_every", float("inf"), ValueError, r"checkpoint_every must be .*Received: checkpoint_every=inf"),
    ("checkpoint_every", [10], TypeError, r"checkpoint_every must be a number of steps .*Received: \[10\] \(list\)"),
    ("backend_env", ["A=1"], TypeError, r"backend_env must be a dict of environment variable names to values"),
    ("backend_env", {"A": None}, TypeError, r"backend_env values must be strings or numbers"),
]


@pytest.mark.parametrize("name,value,exc,match", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_a_wrong_value_is_refused_naming_the_param(name, value, exc, match):
    with pytest.raises(exc, match=match):
        CONVERTERS[name](value)


GOOD = [
    ("num_proc", 2, 2),
    ("store", pathlib.Path("/tmp/s"), pathlib.Path("/tmp/s")),
    ("optimizer", "adam", "adam"),
    ("loss", {"out": "mse"}, {"out": "mse"}),
    ("loss_weights", {"out": 0.5}, {"out": 0.5}),
    ("feature_cols", "x", ["x"]),
    ("feature_cols", [["a", "b"], "c"], [["a", "b"], "c"]),
    ("validation", 0, 0),
    ("validation", "is_val", "is_val"),
    ("start_timeout", 30, 30.0),
    ("stall_timeout", 0, 0),
    ("learning_rate", 1, 1.0),
    ("mlflow", True, True),
    ("mlflow", "ON", "ON"),
    ("use_gpu", False, False),
    ("checkpoint_every", 50, 50),
    ("checkpoint_every", 50.0, 50),
    ("checkpoint_every", "10min", "10min"),
    ("checkpoint_every", " 90s", "90s"),
    ("min_num_proc", 2, 2),
    ("backend_env", {"A": 1, "B": "x"}, {"A": "1", "B": "x"}),
]


@pytest.mark.parametrize("name,value,expected", GOOD, ids=[f"{g[0]}={g[1]!r}" for g in GOOD])
def test_a_right_value_is_kept(name, value, expected):
    assert CONVERTERS[name](value) == expected


def test_every_record_field_has_a_converter():
    assert sorted(CONVERTERS) == sorted(f.name for f in dataclasses.fields(FitParams))


def _values(**kw):
    return dict(dict(store="/tmp/s", model=_Model(), feature_cols=["x"], label_cols=["y"]), **kw)


def test_the_record_is_built_checked_and_frozen():
    p = FitParams.from_params(_values(mlflow=True, backend=None, val_batch_size=None, batch_size=8))
    assert (p.mlflow, p.backend, p.val_batch, p.epochs) == ("on", "gloo", 8, 1)
    assert p.as_dict()["batch_size"] == 8 and set(p.as_dict()) == set(CONVERTERS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.epochs = 3  # type: ignore[misc]
    matched = dataclasses.replace(p, feature_cols=["x"], optimizer=_Optimizer())
    assert matched.feature_cols == ["x"]
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        dataclasses.replace(p, batch_size=0)  # a record is checked however it is made


@pytest.mark.parametrize(
    "missing,match",
    [
        ("store", r"store is required: a path, URL or hvd_spark\.Store"),
        ("model", r"model is required: a built Keras 3 model"),
        ("feature_cols", r"feature_cols must name at least one column"),
        ("label_cols", r"label_cols must name at least one column"),
    ],
)
def test_the_required_params_must_be_given(missing, match):
    with pytest.raises(ValueError, match=match):
        FitParams.from_params(_values(**{missing: None}))


def test_elastic_bounds_are_checked_together():
    p = FitParams.from_params(_values(min_num_proc=2, max_num_proc=4, max_restarts=1))
    assert p.elastic and not FitParams.from_params(_values()).elastic
    with pytest.raises(ValueError, match=r"min_num_proc must be at most max_num_proc\. Received: min_num_proc=3"):
        FitParams.from_params(_values(min_num_proc=3, max_num_proc=2, max_restarts=1))
    with pytest.raises(ValueError, match=r"need max_restarts >= 1"):
        FitParams.from_params(_values(min_num_proc=2))
    with pytest.raises(ValueError, match=r"num_proc \(the ranks to start with\) must lie between"):
        FitParams.from_params(_values(min_num_proc=2, max_num_proc=3, num_proc=4, max_restarts=1))
    with pytest.raises(ValueError, match=r"elastic_timeout applies to elastic training only"):
        FitParams.from_params(_values(elastic_timeout=30))
    with pytest.raises(ValueError, match=r"checkpoint_every .* needs reader='arrow'"):
        FitParams.from_params(_values(checkpoint_every=10, reader="petastorm"))


def test_checkpoint_periods_in_seconds():
    from hvd_spark._internal.ml.fit_params import every_seconds

    assert [every_seconds(x) for x in ("90s", "10min", "1h", "2.5m", 40)] == [90, 600, 3600, 150, None]


def test_params_without_a_none_value_refuse_none_and_unknown_names_are_refused():
    with pytest.raises(TypeError, match=r"epochs must not be None\. Received: epochs=None"):
        FitParams.from_params(_values(epochs=None))
    with pytest.raises(TypeError, match=r"Unknown HorovodEstimator parameters: \['num_processes'\]"):
        FitParams.from_params(_values(num_processes=2))


def test_a_store_object_and_a_backend_object():
    assert FitParams.from_params(_values(store=Store("/tmp/s"))).store == Store("/tmp/s")
    assert is_backend_object(InProcessBackend(2))
    assert not is_backend_object("gloo") and not is_backend_object(object())


def test_numbers_from_numpy_and_search_spaces_are_taken_as_plain_python_numbers():
    import json

    import numpy as np  # the fast tier may load numpy: it is not one of the heavy libraries

    assert CONVERTERS["batch_size"](32.0) == 32 and type(CONVERTERS["batch_size"](np.float64(32.0))) is int
    assert CONVERTERS["epochs"](np.int64(3)) == 3
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        CONVERTERS["batch_size"](32.5)
    assert CONVERTERS["stall_timeout"](np.int64(300)) == 300.0
    v = CONVERTERS["validation"](np.float32(0.25))
    assert type(v) is float and v == 0.25 and json.dumps(v)
    assert CONVERTERS["validation"](0) == 0 and type(CONVERTERS["validation"](0)) is int  # keys stay as they were
    assert json.dumps(CONVERTERS["loss_weights"]([np.float32(0.5), 1])) == "[0.5, 1]"
