"""Credentials in a store's storage options: never written by ``save``, never shown
by ``explainParams()``, never logged; a loaded estimator or transformer given them again works.

A local store's filesystem (fsspec's LocalFileSystem) takes any options and ignores them, so these
tests give it S3-style credentials without an S3 server."""

import logging
import os

import keras
import numpy as np
import pytest
from _helpers import xor_estimator, xor_frame

from hvd_spark import HorovodEstimator, Store, TFTransformer
from hvd_spark._internal.common.specs import specs_to_dicts
from hvd_spark._internal.ml.model_info import model_specs

SECRETS = {"key": "AKIA-KEY-4c1d", "secret": "SECRET-9f2e", "token": "TOKEN-77ab"}
OPTIONS = {
    **SECRETS,
    "endpoint_url": "http://minio.internal:9000",
    "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": "NESTED-SECRET-31d0"},
}
SECRET_VALUES = [*SECRETS.values(), "NESTED-SECRET-31d0"]


def _leaks(folder) -> list[str]:
    """The files under ``folder`` whose bytes hold a secret value (objects.pkl, metadata, the model...)."""
    found = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            found += [f"{name}: {v}" for v in SECRET_VALUES if v.encode() in data]
    return found


def _shown(text: str) -> list[str]:
    return [v for v in SECRET_VALUES if v in text]


def test_a_saved_estimator_holds_no_credential_and_its_params_show_none(spark, tmp_path, caplog):
    store = Store(str(tmp_path / "store"), storage_options=OPTIONS)
    est = xor_estimator(store, epochs=1, verbose=0)
    assert _shown(est.explainParams()) == [] and _shown(str(est.extractParamMap())) == []
    est.save(str(tmp_path / "est"))
    assert _leaks(tmp_path / "est") == []
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        loaded = HorovodEstimator.load(str(tmp_path / "est"))
    # What is not a credential is kept; one INFO line names what was left out, never a value.
    assert loaded.getStore().storage_options == {
        "endpoint_url": "http://minio.internal:9000",
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    lines = [r.getMessage() for r in caplog.records if "without its credentials" in r.getMessage()]
    assert len(lines) == 1 and "key, secret, token, client_kwargs.aws_secret_access_key" in lines[0], lines
    assert _shown(caplog.text) == []
    # Given again, the store is whole and the loaded estimator fits; its model shows no credential either.
    loaded.setStore(Store(str(tmp_path / "store"), storage_options=OPTIONS))
    assert loaded.getStore().storage_options == OPTIONS
    with caplog.at_level(logging.DEBUG, logger="hvd_spark"):
        model = loaded.fit(xor_frame(spark, 64))
    assert _shown(caplog.text) == []
    assert model.getStorageOptions() == OPTIONS
    assert _shown(model.explainParams()) == [] and _shown(str(model.extractParamMap())) == []
    model.save(str(tmp_path / "model"))
    assert _leaks(tmp_path / "model") == []


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    path = str(tmp_path_factory.mktemp("cred_model") / "m.keras")
    model.save(path)
    return path, model


def test_a_transformer_keeps_its_storage_options_out_of_params_and_files(spark, saved_model, tmp_path):
    path, keras_model = saved_model
    inputs, outputs = model_specs(keras_model)
    t = TFTransformer(
        model_url="file://" + path,
        storage_options=OPTIONS,  # the constructor keyword, as fit uses it
        feature_cols=["x"],
        output_cols=["o"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
    )
    assert t.getStorageOptions() == OPTIONS
    assert _shown(t.explainParams()) == [] and _shown(str(t.extractParamMap())) == []
    assert t.copy({t.batch_size: 8}).getStorageOptions() == OPTIONS  # a copy (tuning, pipelines) keeps them
    df = spark.createDataFrame([([1.0, 2.0],), ([0.5, -1.0],)], "x array<double>")
    expected = keras_model.predict(np.array([[1.0, 2.0], [0.5, -1.0]]), verbose=0)[:, 0]
    np.testing.assert_allclose([r["o"] for r in t.transform(df).collect()], expected, rtol=1e-6)
    t.save(str(tmp_path / "t"))
    assert _leaks(tmp_path / "t") == []
    loaded = TFTransformer.load(str(tmp_path / "t"))
    assert loaded.getStorageOptions() == {}
    loaded.setStorageOptions(OPTIONS)  # given again (a model read from a store that needs them)
    np.testing.assert_allclose([r["o"] for r in loaded.transform(df).collect()], expected, rtol=1e-6)
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        loaded.setStorageOptions("key=secret")


def test_a_transformer_saved_when_storage_options_was_a_param_still_loads(spark, saved_model, tmp_path):
    import glob
    import json

    path, keras_model = saved_model
    inputs, outputs = model_specs(keras_model)
    t = TFTransformer(
        model_url="file://" + path,
        feature_cols=["x"],
        input_specs=specs_to_dicts(inputs),
        output_specs=specs_to_dicts(outputs),
    )
    t.save(str(tmp_path / "t"))
    (meta_file,) = glob.glob(str(tmp_path / "t" / "metadata" / "part-*"))
    with open(meta_file) as f:
        meta = json.loads(f.read())
    meta["defaultParamMap"]["storage_options"] = {}  # as earlier versions wrote it
    with open(meta_file, "w") as f:
        f.write(json.dumps(meta))
    for crc in glob.glob(str(tmp_path / "t" / "metadata" / ".*.crc")):  # Hadoop's checksum of the old text
        os.remove(crc)
    loaded = TFTransformer.load(str(tmp_path / "t"))
    assert loaded.getStorageOptions() == {} and not loaded.hasParam("storage_options")
