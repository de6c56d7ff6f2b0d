"""The estimator's Params against their one table (``fit_params.DEFAULTS``): the constructor's signature,
``_setDefault``, ``FitParams``, the Params declared and the docs' grouped table all agree with it; and
every Param's converter follows one rule: ``TypeError`` for a wrong type, ``ValueError`` for a value
it cannot take, the message naming the Param.

Pyspark-free (the fast tier must not load it): the estimator's signature and its ``_setDefault`` call
are read from estimator.py's source, the Params declared from params.py's. tests/test_param_defaults.py
checks the live objects."""

import ast
import dataclasses
import math
import pathlib
import re

import pytest

from hvd_spark._internal.ml.converters import CONVERTERS
from hvd_spark._internal.ml.fit_params import COMPATIBILITY, DEFAULTS, HOW_IT_RUNS, LEARNS, FitParams

ML = pathlib.Path(__file__).resolve().parents[2] / "hvd_spark" / "_internal" / "ml"
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "estimator.md"
INF, NAN = float("inf"), float("nan")


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _estimator_init() -> ast.FunctionDef:
    tree = ast.parse((ML / "estimator.py").read_text())
    cls = _class(tree, "HorovodEstimator")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def signature_defaults(init: ast.FunctionDef) -> dict:
    """``{name: default}`` of the keyword-only arguments of ``__init__`` (literals, as the source says)."""
    args = init.args
    assert not args.args[1:] and not args.defaults, "the estimator's Params are keyword-only"
    missing = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    assert not missing, f"keyword arguments without a default: {missing}"
    return {a.arg: ast.literal_eval(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}


def set_default_values(init: ast.FunctionDef) -> dict:
    """What ``__init__``'s ``self._setDefault(...)`` call sets: its literal keywords, and ``**DEFAULTS``."""
    calls = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_setDefault"
    ]
    assert len(calls) == 1, "__init__ sets the defaults in one _setDefault call"
    out: dict = {}
    for kw in calls[0].keywords:
        if kw.arg is None:  # **something: only the table itself
            assert isinstance(kw.value, ast.Name) and kw.value.id == "DEFAULTS", ast.unparse(kw.value)
            out.update(DEFAULTS)
        else:
            out[kw.arg] = ast.literal_eval(kw.value)
    assert not calls[0].args
    return out


def declared_params() -> list[str]:
    """The names of the Params ColumnParams and EstimatorParams declare (``name = _checked(...)`` / ``_param``)."""
    tree = ast.parse((ML / "params.py").read_text())
    names = []
    for cls in ("ColumnParams", "EstimatorParams"):
        for node in _class(tree, cls).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return names


def _same(a, b) -> bool:
    return a == b and type(a) is type(b)


def test_the_table_holds_every_param_once_in_one_group():
    assert len(DEFAULTS) == len(LEARNS) + len(HOW_IT_RUNS) + len(COMPATIBILITY)  # no name in two groups
    assert sorted(declared_params()) == sorted(DEFAULTS)
    assert sorted(CONVERTERS) == sorted(DEFAULTS)
    assert sorted(f.name for f in dataclasses.fields(FitParams)) == sorted(DEFAULTS)


def test_the_signature_and_set_default_take_the_defaults_of_the_table():
    init = _estimator_init()
    for source, values in (("signature", signature_defaults(init)), ("_setDefault", set_default_values(init))):
        assert sorted(values) == sorted(DEFAULTS), source
        drifted = {k: (v, DEFAULTS[k]) for k, v in values.items() if not _same(v, DEFAULTS[k])}
        assert not drifted, f"{source} differs from fit_params.DEFAULTS: {drifted}"


def test_fit_params_takes_the_defaults_of_the_table():
    own = {f.name: f.default for f in dataclasses.fields(FitParams) if f.default is not dataclasses.MISSING}
    assert not own, f"FitParams' fields take their defaults from DEFAULTS, not their own: {own}"
    required = dict(store="/tmp/s", model=_Model(), feature_cols=["x"], label_cols=["y"])
    built = FitParams.from_params(required).as_dict()
    drifted = {k: (v, DEFAULTS[k]) for k, v in built.items() if k not in required and not _same(v, DEFAULTS[k])}
    assert not drifted, f"FitParams differs from fit_params.DEFAULTS: {drifted}"


def test_the_check_of_the_signature_catches_a_drift():
    """The readers above see a changed default (so that the tests cannot pass by reading nothing)."""
    init = _estimator_init()
    source = ast.unparse(init).replace("batch_size: int=32", "batch_size: int=64", 1)
    assert "batch_size: int=64" in source
    drifted = signature_defaults(ast.parse(source).body[0])  # type: ignore[arg-type]
    assert drifted["batch_size"] == 64
    fake = ast.parse("def __init__(self):\n    self._setDefault(**DEFAULTS, epochs=2)").body[0]
    assert set_default_values(fake)["epochs"] == 2  # type: ignore[arg-type]


def _docs_groups() -> dict[str, list[str]]:
    """``{group heading: names}`` of the docs' Params tables (the first column's backticked names)."""
    groups: dict[str, list[str]] = {}
    current = None
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^### Params: (.+)$", line)
        if m:
            current = groups.setdefault(m.group(1), [])
        elif line.startswith("#"):
            current = None
        elif current is not None and line.startswith("| `"):
            current += re.findall(r"`(\w+)`", line.split("|")[1])
    return groups


def test_the_docs_list_every_param_in_its_group():
    assert _docs_groups() == {
        "what the model learns": list(LEARNS),
        "how it runs": list(HOW_IT_RUNS),
        "compatibility": list(COMPATIBILITY),
    }


# --- the converters: one rule for every Param ---


class _Model:  # what the converter recognizes a Keras model by (fit checks keras.Model itself)
    layers: list = []

    def get_weights(self):
        return []


# A value of the wrong type for every Param: TypeError.
WRONG_TYPE = {
    "num_proc": ["2", True],
    "store": [3],
    "model": ["not a model"],
    "optimizer": [0.1],
    "loss": [3],
    "loss_weights": [["a"], {"out": True}, 0.5],
    "metrics": ["accuracy"],
    "learning_rate": ["0.1", True],
    "custom_objects": [["f"], {1: print}],
    "feature_cols": [[1], 3],
    "label_cols": [[["a", 1]], 3],
    "output_cols": [3],
    "sample_weight_col": [1],
    "validation": [[0.1], True],
    "callbacks": ["cb"],
    "class_weight": [[1.0], {0: "x"}, {"a": 1.0}, {0: True}],
    "validation_freq": ["1", True, [True], ["1"]],
    "batch_size": ["32", True, None, [32]],
    "val_batch_size": ["8", False],
    "epochs": [True, "3"],
    "train_steps_per_epoch": ["10"],
    "validation_steps_per_epoch": [[1]],
    "shuffle": [1, "yes"],
    "shuffle_buffer_size": ["10"],
    "random_seed": ["7", False],
    "run_id": [5],
    "verbose": ["1", True],
    "backend": [2],
    "start_timeout": ["soon", "30", [1], True],
    "stall_timeout": ["never", [300], True],
    "use_gpu": [1, "yes"],
    "max_restarts": [True, "1"],
    "min_num_proc": ["2"],
    "max_num_proc": [complex(2, 0)],
    "elastic_timeout": [True, "60"],
    "checkpoint_every": [[10], True, {"s": 1}],
    "keep_checkpoints": ["2", True],
    "backend_env": [["A=1"], {"A": None}, {1: "x"}, {"A": True}],
    "mp_start_method": [1],
    "tensorflow_dataset_prefetch_buffer_size": ["0", False],
    "partitions_per_process": [False],
    "transformation_fn": ["f"],
    "train_reader_num_workers": ["2"],
    "val_reader_num_workers": [True],
    "reader_pool_type": [1],
    "label_shapes": ["2", [2], [["a"]], [[True]]],
    "checkpoint_callback": ["cb", object()],
    "inmemory_cache_all": ["yes", 0],
    "backward_passes_per_step": [True],
    "gradient_compression": [16],
    "reader": [1],
    "materialize": [True],
    "reuse_data": [["auto"]],
    "task": [1],
    "mlflow": [2, 1.0],
}
# None only, as in horovod.spark's NVTabular-less installs: any other value is refused as unsupported
# (ValueError), whatever its type.
NO_WRONG_TYPE = {"data_module", "continuous_cols", "categorical_cols"}

# A value of the right type that the Param cannot take: ValueError.
BAD_VALUE = {
    "num_proc": [0, -1, 2.5, INF, NAN],
    "loss_weights": [[INF], {"out": NAN}],
    "learning_rate": [0, -0.1, INF, NAN],
    "validation": [1.0, -0.2, INF, NAN],
    "class_weight": [{}, {0: -1}, {0: INF}, {-1: 1.0}, {1.5: 1.0}, {0: NAN}],
    "validation_freq": [0, 2.5, [], [0, 2], [1.5]],
    "batch_size": [0, -1, 2.5, INF, NAN],
    "val_batch_size": [0],
    "epochs": [0, INF],
    "train_steps_per_epoch": [0],
    "validation_steps_per_epoch": [0],
    "shuffle_buffer_size": [0],
    "random_seed": [2.5, NAN],
    "run_id": ["../escape", ""],
    "verbose": [3, -1, 1.5],
    "backend": ["nccl"],
    "start_timeout": [0, -1, INF, NAN],
    "stall_timeout": [2, -1, INF, NAN],
    "max_restarts": [-1, 0.5],
    "min_num_proc": [0],
    "max_num_proc": [0, 1.5],
    "elastic_timeout": [0, INF],
    "checkpoint_every": [0, -3, 2.5, INF, NAN, "often", "10 days"],
    "keep_checkpoints": [0, -1, 1.5],
    "backend_env": [{"": "1"}, {"A=B": "1"}],
    "mp_start_method": ["thread"],
    "tensorflow_dataset_prefetch_buffer_size": [-1],
    "partitions_per_process": [0],
    "train_reader_num_workers": [0],
    "val_reader_num_workers": [0],
    "reader_pool_type": ["process", "threads"],
    "label_shapes": [[[0]], [[2, 1.5]]],
    "data_module": [object()],
    "continuous_cols": [["a"]],
    "categorical_cols": [["a"]],
    "backward_passes_per_step": [0],
    "gradient_compression": ["int8"],
    "reader": ["parquet"],
    "materialize": ["sometimes"],
    "reuse_data": ["sometimes"],
    "task": ["multiclass"],
    "mlflow": ["yes"],
}
# Every value of the right type is one they take (what they hold is checked when fit starts: the
# model against the columns, the columns against the DataFrame, the store's reach, ...).
NO_BAD_VALUE = {
    "store": "a path or URL is checked when fit starts (reachable, writable)",
    "model": "built, compiled: checked when fit starts",
    "optimizer": "a name Keras knows: checked when fit starts",
    "loss": "a name Keras knows: checked when fit starts",
    "metrics": "names Keras knows: checked when fit starts",
    "custom_objects": "any name -> object",
    "feature_cols": "the columns are matched to the model and the DataFrame when fit starts",
    "label_cols": "as feature_cols",
    "output_cols": "as feature_cols",
    "sample_weight_col": "a column of the DataFrame: checked when fit starts",
    "callbacks": "each must pickle: checked when fit starts",
    "shuffle": "a bool",
    "use_gpu": "a bool or None",
    "transformation_fn": "any function",
    "checkpoint_callback": "any ModelCheckpoint",
    "inmemory_cache_all": "a bool",
}


def _cases(table):
    return [pytest.param(name, v, id=f"{name}={v!r}") for name, values in table.items() for v in values]


def test_every_param_has_its_cases():
    assert sorted([*WRONG_TYPE, *NO_WRONG_TYPE]) == sorted(DEFAULTS)
    assert sorted([*BAD_VALUE, *NO_BAD_VALUE]) == sorted(DEFAULTS)


@pytest.mark.parametrize("name,value", _cases(WRONG_TYPE))
def test_a_value_of_the_wrong_type_is_a_type_error_naming_the_param(name, value):
    with pytest.raises(TypeError) as e:
        CONVERTERS[name](value)
    assert name in str(e.value)


@pytest.mark.parametrize("name,value", _cases(BAD_VALUE))
def test_a_value_the_param_cannot_take_is_a_value_error_naming_the_param(name, value):
    with pytest.raises(ValueError) as e:
        CONVERTERS[name](value)
    assert name in str(e.value)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_a_bool_is_no_number(name):
    """Python's bool is an int; no numeric Param takes one (``True`` is no batch size)."""
    conv = CONVERTERS[name]
    for number, flag in ((0, False), (1, True), (10, True), (0.5, True)):
        try:
            conv(number)
        except (TypeError, ValueError):
            continue  # the Param takes no such number (mlflow takes True / False: on / off)
        with pytest.raises(TypeError, match=name):
            conv(flag)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_each_default_passes_its_converter_unchanged(name):
    default = DEFAULTS[name]
    if default is not None:
        assert _same(CONVERTERS[name](default), default)


def test_whole_floats_and_numpy_numbers_stay_counts():
    import numpy as np  # the fast tier may load numpy: it is not one of the heavy libraries

    assert _same(CONVERTERS["batch_size"](32.0), 32) and _same(CONVERTERS["epochs"](np.int64(3)), 3)
    assert _same(CONVERTERS["checkpoint_every"](np.float32(50.0)), 50)
    assert _same(CONVERTERS["validation_freq"]([2.0, 1]), [1, 2])
    assert _same(CONVERTERS["learning_rate"](np.float32(0.5)), 0.5)
    assert math.isnan(NAN)  # (the cases above rely on nan being a float)


def test_the_estimator_docstring_names_every_param():
    doc = ast.get_docstring(_class(ast.parse((ML / "estimator.py").read_text()), "HorovodEstimator")) or ""
    assert [name for name in DEFAULTS if not re.search(rf"\b{name}\b", doc)] == []
