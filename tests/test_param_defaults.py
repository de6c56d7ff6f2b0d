"""The estimator's live Params against their one table (``fit_params.DEFAULTS``): ``help()``'s signature,
the defaults Spark ML holds, and every Param's converter as the constructor and ``setParams`` run it.
tests/fast/test_param_table.py checks the same from the sources, without pyspark; its cases are used
here as they are."""

import importlib.util
import inspect
import pathlib

import pytest

import hvd_spark
from hvd_spark._internal.ml.fit_params import DEFAULTS


def _fast_cases():
    path = pathlib.Path(__file__).resolve().parent / "fast" / "test_param_table.py"
    spec = importlib.util.spec_from_file_location("_param_table_cases", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _fast_cases()


def _same(values: dict) -> dict:
    """The entries of ``values`` that differ from DEFAULTS (in value or type)."""
    return {
        k: (v, DEFAULTS.get(k))
        for k, v in values.items()
        if v != DEFAULTS.get(k) or type(v) is not type(DEFAULTS.get(k))
    }


def test_the_signature_and_the_spark_ml_defaults_are_the_table():
    sig = inspect.signature(hvd_spark.HorovodEstimator.__init__)  # @keyword_only keeps __wrapped__
    params = {n: p for n, p in sig.parameters.items() if n != "self"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    signature = {n: p.default for n, p in params.items()}
    assert sorted(signature) == sorted(DEFAULTS) and not _same(signature)

    est = hvd_spark.HorovodEstimator()
    assert sorted(p.name for p in est.params) == sorted(DEFAULTS)
    held = {p.name: v for p, v in est._defaultParamMap.items()}
    assert sorted(held) == sorted(DEFAULTS) and not _same(held)
    assert not _same({p.name: est.getOrDefault(p) for p in est.params})


def _set_cases(table):
    # Spark ML's _set skips the converter for None (fit's record refuses None where a Param cannot be None).
    return [
        pytest.param(name, v, id=f"{name}={v!r}") for name, values in table.items() for v in values if v is not None
    ]


@pytest.mark.parametrize("name,value", _set_cases(CASES.WRONG_TYPE))
def test_a_wrong_type_is_a_type_error_at_the_constructor_and_set_params(name, value):
    for build in (
        lambda: hvd_spark.HorovodEstimator(**{name: value}),
        lambda: hvd_spark.HorovodEstimator().setParams(**{name: value}),
    ):
        with pytest.raises(TypeError, match=name):
            build()


@pytest.mark.parametrize("name,value", _set_cases(CASES.BAD_VALUE))
def test_a_bad_value_is_a_value_error_at_the_constructor_and_set_params(name, value):
    for build in (
        lambda: hvd_spark.HorovodEstimator(**{name: value}),
        lambda: hvd_spark.HorovodEstimator().setParams(**{name: value}),
    ):
        with pytest.raises(ValueError, match=name):
            build()
