"""What a fit does between two epochs, kept short (issue 49), without changing a number.

- A rank's validation rows are read at the first validation and kept in memory (``kept_batches``), the
  same tensors in the same batches, when they fit ``HVD_SPARK_KEEP_VALIDATION_BYTES``.
- Rank 0's starting state reaches the other ranks in one fused collective per dtype, bit for bit.
- The ranks agree on ``model.stop_training`` only where a user's callback could have asked for it.

Real Keras; the collectives and the fit run on 2 real Horovod ranks over Gloo (``hvd_spark.run``,
``HorovodEstimator`` on ``local[2]``).
"""

import sys

import cloudpickle
import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import hvd_spark
from hvd_spark import HorovodEstimator, Store
from hvd_spark._internal.rank.callbacks import ExactValidationCallback, acts_on_epochs, acts_on_steps, kept_batches

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank functions travel by value


class _OnTrainEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        pass


class _OnTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        pass


class _OwnEarlyStopping(keras.callbacks.EarlyStopping):
    """A subclass: it may decide from more than the logs."""


@pytest.mark.parametrize(
    "make, at_epochs, at_steps",
    [
        (lambda: [], False, False),
        (lambda: [keras.callbacks.EarlyStopping(), keras.callbacks.ReduceLROnPlateau()], False, False),
        (lambda: [keras.callbacks.CSVLogger("h.csv"), keras.callbacks.ModelCheckpoint("m.keras")], False, False),
        (lambda: [_OnTrainEnd()], False, False),
        (lambda: [_OnTrainBegin()], True, False),
        (lambda: [_OwnEarlyStopping()], True, False),
        (lambda: [keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: None)], True, False),
        (lambda: [keras.callbacks.TerminateOnNaN()], False, True),
        (lambda: [keras.callbacks.LambdaCallback(on_batch_end=lambda b, logs: None)], False, True),
    ],
)
def test_the_ranks_agree_on_a_stop_where_a_callback_could_ask_for_one(make, at_epochs, at_steps):
    callbacks = make()
    assert acts_on_epochs(callbacks) is at_epochs
    assert acts_on_steps(callbacks) is at_steps


def _counted(rows: int = 10, batch: int = 4):
    """A dataset of ``rows`` rows in batches of ``batch`` (a last part) and the list its passes append to."""
    passes: list = []

    def gen():
        passes.append(1)
        for i in range(0, rows, batch):
            k = min(batch, rows - i)
            x = np.arange(i, i + k, dtype="float32")[:, None] / rows
            yield {"x": x}, (x[:, 0] * 3 - 1).astype("float32")

    spec = ({"x": tf.TensorSpec((None, 1), tf.float32)}, tf.TensorSpec((None,), tf.float32))
    return tf.data.Dataset.from_generator(gen, output_signature=spec), passes


def test_kept_validation_batches_are_the_same_tensors_read_once():
    ds, passes = _counted()
    kept = kept_batches(ds, 3, 1 << 20)
    assert len(passes) == 1
    got, want = list(kept), list(ds)
    assert [len(b[1]) for b in got] == [4, 4, 2]
    for a, b in zip(got, want):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)
    assert kept_batches(ds, 3, 10 * 8 - 1) is None  # 10 rows of two float32 values: 80 bytes
    assert kept_batches(ds, 3, 10 * 8) is not None

    inputs = keras.Input((1,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", metrics=["mae"])
    cb = ExactValidationCallback(ds, None, batches=3, keep_bytes=1 << 20)
    passes.clear()
    first, second = cb._source(3), cb._source(3)
    assert first is second and len(passes) == 1  # read once, at the first validation
    assert model.evaluate(first, steps=3, verbose=0) == model.evaluate(ds, steps=3, verbose=0)
    assert ExactValidationCallback(ds, 2, batches=3, keep_bytes=1 << 20)._source(2) is ds  # a part: read each time
    assert ExactValidationCallback(ds, None, batches=3, keep_bytes=0)._source(3) is ds  # off


_VALUES = {
    "float32": np.array([-0.0, np.nan, 1e-45, 3.4e38, -1.5], "float32"),
    "float64": np.array([np.inf, -0.0, 5e-324], "float64"),
    "int64": np.array([2**62 + 1, -(2**62)], "int64"),
    "int32": np.array([[7, -7]], "int32"),
    "bool": np.array([True, False]),
    "bfloat16": np.array([1.5, -0.0, np.nan], "float32"),  # Horovod neither sums nor broadcasts it
    "int16": np.array([-3, 2**14], "int16"),
    "float16": np.array([-0.0, 6e-8], "float16"),
}


def _broadcast_on_a_rank():
    import horovod.tensorflow as hvd

    from hvd_spark.keras import broadcast_variables, reconcile_variables

    hvd.init()
    mine = hvd.rank() == 0
    variables = [
        keras.Variable(v if mine else np.ones_like(v), dtype=dtype, trainable=False) for dtype, v in _VALUES.items()
    ]
    broadcast_variables(variables)
    got = [(v.dtype, np.asarray(keras.ops.convert_to_numpy(v)).tobytes().hex()) for v in variables]
    r = float(hvd.rank())
    differ = [keras.Variable([r], dtype=d, trainable=False) for d in ("float32", "bfloat16", "float16", "int64")]
    same = keras.Variable([-0.0], dtype="float32", trainable=False)
    changed = reconcile_variables([*differ, same])
    averaged = [float(keras.ops.convert_to_numpy(keras.ops.cast(v, "float32"))[0]) for v in differ]
    return got, changed, averaged, np.asarray(same).tobytes().hex()


def test_rank_zeros_state_reaches_every_rank_bit_for_bit(spark):
    """And state that differs is averaged per dtype (bfloat16 and float16 beside float32), integers taken from
    rank 0, what agrees left as it is."""
    ranks = hvd_spark.run(_broadcast_on_a_rank, num_proc=2, verbose=0)
    assert ranks[0] == ranks[1]
    got, changed, averaged, same = ranks[0]
    assert (changed, averaged, same) == (4, [0.5, 0.5, 0.5, 0.0], np.array([-0.0], "float32").tobytes().hex())
    first = dict(got)
    for dtype, value in _VALUES.items():  # -0.0, NaN, subnormals, the largest ints: every bit as on rank 0
        want = keras.ops.convert_to_numpy(keras.ops.cast(value, dtype))
        assert bytes.fromhex(first[dtype]) == np.asarray(want).tobytes(), dtype


def _pandas_frame(spark, n_train: int, n_val: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_train + n_val, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype("int64")
    is_val = np.arange(n_train + n_val) >= n_train
    return x, y, spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y, "is_val": is_val}))


def _model():
    keras.utils.set_random_seed(4)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m.compile(keras.optimizers.Adam(0.05), loss, metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy()])
    return m


def test_two_ranks_on_a_pandas_frame_equal_plain_keras_at_the_global_batch(spark, tmp_path):
    """The driver's copy of a small pandas-made frame, the validation rows kept in memory, the start
    broadcast fused: 2 ranks at B = 32 equal Keras at 64. The 64 training rows are one global batch,
    so the epoch's gradient is the same whichever rank reads which row; 24 validation rows."""
    n_train, n_val, epochs = 64, 24, 5
    x, y, df = _pandas_frame(spark, n_train, n_val)
    plain = _model()
    want = plain.fit(
        x[:n_train], y[:n_train], batch_size=2 * 32, epochs=epochs, shuffle=False,
        validation_data=(x[n_train:], y[n_train:]), verbose=0,
    ).history  # fmt: skip
    est = HorovodEstimator(
        num_proc=2, store=Store(str(tmp_path / "store")), model=_model(), feature_cols=["x"], label_cols=["y"],
        validation="is_val", batch_size=32, epochs=epochs, verbose=0,
    )  # fmt: skip
    fitted = est.fit(df)
    got = fitted.getHistory()
    assert sorted(got) == sorted(want)
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=1e-6, err_msg=f"history[{key!r}]")
    for i, (a, b) in enumerate(zip(fitted.getModel().get_weights(), plain.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
    assert fitted.getFitSummary().steps_per_epoch == 1
