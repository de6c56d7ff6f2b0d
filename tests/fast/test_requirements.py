"""What hvd_spark says when pyspark or TensorFlow is missing: a bare `pip install hvd_spark` has
neither, and the error names the extras that bring them (pyproject.toml, docs/install.md)."""

import pytest

from hvd_spark._internal.common import requirements


@pytest.fixture
def only(monkeypatch):
    """Pretends that only the given top-level modules are installed."""

    def install(*present):
        monkeypatch.setattr(requirements, "installed", lambda module: module in present)

    return install


def test_nothing_missing_gives_no_message(only):
    only("pyspark", "tensorflow", "keras")
    assert requirements.missing_message("HorovodEstimator", spark=True, tensorflow=True) is None
    requirements.require("HorovodEstimator", spark=True, tensorflow=True)


def test_missing_pyspark_names_the_spark_extras(only):
    only("tensorflow", "keras")
    with pytest.raises(ModuleNotFoundError, match=r"needs pyspark") as e:
        requirements.require("hvd_spark.run", spark=True)
    assert "hvd_spark[spark]" in str(e.value) and "hvd_spark[connect-client]" in str(e.value)
    assert str(e.value).startswith("hvd_spark.run needs pyspark")


def test_missing_tensorflow_names_the_cpu_and_gpu_extras(only):
    only("pyspark", "keras")
    with pytest.raises(ModuleNotFoundError, match=r"TensorFlow is not installed") as e:
        requirements.require("TFTransformer", spark=True, tensorflow=True)
    assert "hvd_spark[cpu]" in str(e.value) and "hvd_spark[gpu]" in str(e.value)


def test_missing_keras_is_named(only):
    only("pyspark", "tensorflow")
    assert "Keras is not installed" in requirements.missing_message("HorovodEstimator", tensorflow=True)


def test_spark_is_not_asked_for_unless_needed(only):
    only("tensorflow", "keras")
    assert requirements.missing_message("x", tensorflow=True) is None


def test_the_package_asks_before_loading_the_estimator(only):
    import hvd_spark

    only()
    with pytest.raises(ModuleNotFoundError, match=r"HorovodEstimator needs pyspark"):
        hvd_spark.HorovodEstimator  # noqa: B018
