"""The model call of transform's workers (``infer/batching.py``'s ``predictor``): the model's own
predict step compiled once per model and called on numpy, with the same numbers as Keras' own
``model.predict``, for several inputs and outputs, and no new trace per batch size."""

import numpy as np
import pyarrow as pa
import pytest

from hvd_spark._internal.infer.batching import predict_arrow_batches, predict_columns, predictor
from hvd_spark._internal.ml.model_info import model_specs
from hvd_spark.errors import InvalidFeatureError


def _two_in_two_out():
    """Inputs ``a`` (3 floats) and ``b`` (one int); outputs ``pair`` (2 values) and ``one`` (1)."""
    import keras

    keras.utils.set_random_seed(1)
    a = keras.Input((3,), name="a")
    b = keras.Input((1,), name="b", dtype="int32")
    h = keras.layers.Concatenate()([a, keras.ops.cast(b, "float32")])
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model([a, b], [keras.layers.Dense(2, name="pair")(h), keras.layers.Dense(1, name="one")(h)])


def _list_column(x: np.ndarray) -> pa.Array:
    n, k = x.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), pa.array(x.reshape(-1)))


def test_several_inputs_and_outputs_give_keras_own_predictions_in_any_batch_split():
    model = _two_in_two_out()
    inputs, outputs = model_specs(model)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(23, 3)).astype("float32")
    b = rng.integers(0, 5, size=(23, 1)).astype("int32")
    want = model.predict([a, b], verbose=0)
    cols = [_list_column(a), pa.array(b[:, 0])]
    for batch_size in (4, 7, 23, 100):  # chunks of 4, 4, ..., 3; of 7, ..., 2; the whole batch
        got = predict_columns(model, cols, 23, inputs, outputs, batch_size, ["a", "b"])
        assert got[0].shape == (23, 2) and got[1].shape == (23, 1)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    # One compiled function per model, traced at most twice (a first batch size, then an open batch
    # axis) whatever the batch sizes: every later call runs the same graph.
    fn = predictor(model)
    assert fn is predictor(model)
    assert fn.compiled.experimental_get_tracing_count() <= 2


def test_the_arrow_path_predicts_a_classifier_batch_like_model_predict():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    inputs, outputs = model_specs(model)
    x = np.random.default_rng(2).normal(size=(1000, 32)).astype("float32")
    x[5, 3] = np.nan  # a NaN makes its row invalid: refused, or (keep_invalid) a null prediction
    x[7, 0] = -np.inf
    struct = pa.StructArray.from_arrays([_list_column(x)], names=["_f0"])
    with pytest.raises(InvalidFeatureError, match=r"Feature column 'x' has 2 rows with NaN or infinite values"):
        list(predict_arrow_batches(model, iter([struct]), inputs, outputs, ["x"], ["p"], 300))
    (got,) = list(predict_arrow_batches(model, iter([struct]), inputs, outputs, ["x"], ["p"], 300, keep_invalid=True))
    want = model.predict(np.delete(x, [5, 7], axis=0), verbose=0)[:, 0]
    assert got.type == pa.float64() and got.null_count == 2
    values = got.to_numpy(zero_copy_only=False)
    assert np.isnan(values[[5, 7]]).all()  # the nulls
    np.testing.assert_allclose(np.delete(values, [5, 7]), want, rtol=1e-5, atol=1e-6)


def test_a_model_without_a_predict_step_is_called_through_predict_on_batch():
    class Lengths:  # a stand-in: each call's row count, so the split into calls shows
        def __init__(self):
            self.calls: list[int] = []

        def predict_on_batch(self, x):
            self.calls.append(len(x))
            return np.full((len(x), 1), float(len(x)))

    from hvd_spark._internal.common.specs import TensorSpec

    model = Lengths()
    spec = TensorSpec(name="x", shape=(2,), dtype="float32")
    out = TensorSpec(name="o", shape=(1,), dtype="float32")
    got = predict_columns(model, [np.zeros((10, 2), dtype="float32")], 10, [spec], [out], 4, ["x"])
    assert model.calls == [4, 4, 2]
    assert got[0][:, 0].tolist() == [4.0] * 8 + [2.0] * 2


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
