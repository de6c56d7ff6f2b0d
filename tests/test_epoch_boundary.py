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
from hvd_spark._internal.rank.callbacks import (
    ExactValidationCallback,
    acts_at_epoch_ends,
    acts_at_epoch_starts,
    acts_on_steps,
    kept_batches,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank functions travel by value


class _OnTrainEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        pass


class _OnTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        pass


class _StepTimer(keras.callbacks.Callback):
    may_stop_training = False

    def on_train_begin(self, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_epoch_end(self, epoch, logs=None):
        pass


class _OwnEarlyStopping(keras.callbacks.EarlyStopping):
    """A subclass: it may decide from more than the logs."""


@pytest.mark.parametrize(
    "make, at_starts, at_ends, at_steps",
    [
        (lambda: [], False, False, False),
        (lambda: [keras.callbacks.EarlyStopping(), keras.callbacks.ReduceLROnPlateau()], False, True, False),
        (lambda: [keras.callbacks.CSVLogger("h.csv"), keras.callbacks.ModelCheckpoint("m.keras")], False, False, False),
        (lambda: [_OnTrainEnd()], False, False, False),
        (lambda: [_OnTrainBegin()], True, False, False),
        (lambda: [_OwnEarlyStopping()], True, True, False),
        (lambda: [_patched_early_stopping()], True, True, False),
        (lambda: [keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: None)], False, True, False),
        (lambda: [keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: None)], True, False, False),
        (lambda: [keras.callbacks.TerminateOnNaN()], False, False, True),
        (lambda: [keras.callbacks.LambdaCallback(on_batch_end=lambda b, logs: None)], False, False, True),
        (lambda: [_StepTimer()], False, False, False),  # says it never stops training
    ],
)
def test_the_ranks_agree_on_a_stop_where_a_callback_could_ask_for_one(make, at_starts, at_ends, at_steps):
    callbacks = make()
    assert acts_at_epoch_starts(callbacks) is at_starts
    assert acts_at_epoch_ends(callbacks) is at_ends
    assert acts_on_steps(callbacks) is at_steps


def _patched_early_stopping():
    cb = keras.callbacks.EarlyStopping()
    cb.on_epoch_begin = lambda epoch, logs=None: None  # the user's own code at the start
    return cb


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
    assert kept_batches(ds, 3, 4, 3 * 4 * 8 - 1) is None  # 3 batches of 4 rows of two float32 values: 96 bytes
    assert passes == []  # decided before reading: a reader is never left half read
    kept = kept_batches(ds, 3, 4, 3 * 4 * 8)
    assert len(passes) == 1
    got, want = list(kept), list(ds)
    assert [len(b[1]) for b in got] == [4, 4, 2]
    for a, b in zip(got, want):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)

    inputs = keras.Input((1,), name="x")
    model = keras.Model({"x": inputs}, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", metrics=["mae"])
    cb = ExactValidationCallback(ds, None, batches=3, keep_bytes=1 << 20, batch_size=4)
    passes.clear()
    first, second = cb._source(3), cb._source(3)
    assert first is second and len(passes) == 1  # read once, at the first validation
    assert model.evaluate(first, steps=3, verbose=0) == model.evaluate(ds, steps=3, verbose=0)
    part = ExactValidationCallback(ds, 2, batches=3, keep_bytes=1 << 20, batch_size=4)
    assert part._source(2) is ds  # a part of the batches: read each time
    assert ExactValidationCallback(ds, None, batches=3, keep_bytes=0, batch_size=4)._source(3) is ds  # off


def _validate_on_a_rank():
    """Three validations of this rank's rows (other rows on each rank: dict inputs, sample weights, a last
    part) with the rows kept and with them read each time, through the metrics' allreduce."""
    import horovod.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    rng = np.random.default_rng(r)
    x, y, w = rng.normal(size=(11, 3)).astype("float32"), rng.normal(size=(11,)), rng.uniform(0.5, 2, size=11)
    passes: list = []

    def gen():
        passes.append(1)
        for i in range(0, 11, 4):
            yield {"a": x[i : i + 4, :2], "b": x[i : i + 4, 2:]}, y[i : i + 4].astype("float32"), w[i : i + 4]

    spec = (
        {"a": tf.TensorSpec((None, 2), tf.float32), "b": tf.TensorSpec((None, 1), tf.float32)},
        tf.TensorSpec((None,), tf.float32),
        tf.TensorSpec((None,), tf.float64),
    )
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)
    keras.utils.set_random_seed(1)
    a, b = keras.Input((2,), name="a"), keras.Input((1,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    model.compile("sgd", "mse", metrics=["mae", keras.metrics.RootMeanSquaredError()], weighted_metrics=["mse"])
    out = {}
    for keep in (1 << 20, 0):
        cb = ExactValidationCallback(ds, None, batches=3, keep_bytes=keep, batch_size=4)
        cb.set_model(model)
        passes.clear()
        logs = []
        for epoch in range(3):
            logs.append({})
            cb.on_epoch_end(epoch, logs[-1])
        out[keep] = (len(passes), logs)
    return out[1 << 20], out[0]


def test_a_kept_validation_reads_once_and_gives_every_rank_the_same_numbers(spark):
    ranks = hvd_spark.run(_validate_on_a_rank, num_proc=2, verbose=0)
    assert ranks[0] == ranks[1]  # the metrics over both ranks' rows
    (kept_passes, kept_logs), (read_passes, read_logs) = ranks[0]
    assert (kept_passes, read_passes) == (1, 3)
    assert kept_logs == read_logs and set(kept_logs[0]) == {"val_loss", "val_mae", "val_root_mean_squared_error",
                                                            "val_mse"}  # fmt: skip


def test_torch_validation_batches_are_kept_as_compact_copies(monkeypatch):
    from types import SimpleNamespace

    from hvd_spark._internal.rank import torch_parts

    rows = np.arange(40, dtype="float32").reshape(20, 2)
    reads: list = []

    def val_batches(cfg, rank, size):
        reads.append(1)
        for i in range(0, 20, 8):
            yield {"x": rows[i : i + 8], "y": rows[i : i + 8, 0].astype("int64")}  # views of the rows read

    monkeypatch.setattr(torch_parts, "val_batches", val_batches)
    setup = SimpleNamespace(cfg=None, _val_budget=1 << 20, _val_kept=None)
    first = list(torch_parts.TorchSetup._val_batches(setup, 0, 1))
    second = list(torch_parts.TorchSetup._val_batches(setup, 0, 1))
    assert len(reads) == 1 and [len(b["x"]) for b in second] == [8, 8, 4]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["x"], b["x"])
        assert b["x"].base is None  # its own copy: not the whole block it was a view of
    small = SimpleNamespace(cfg=None, _val_budget=100, _val_kept=None)  # 20 rows x (8 + 8) bytes > 100
    list(torch_parts.TorchSetup._val_batches(small, 0, 1))
    list(torch_parts.TorchSetup._val_batches(small, 0, 1))
    assert len(reads) == 3


def _bits(dtype: str, *words: int) -> np.ndarray:
    """Values of ``dtype`` made from their bit patterns (NaN payloads, signaling NaNs)."""
    ints = {"float16": "uint16", "float32": "uint32", "float64": "uint64"}[dtype]
    return np.array(words, ints).view(dtype)


_VALUES = {
    "float32": np.concatenate(
        [np.array([-0.0, 1e-45, 3.4e38, -1.5], "float32"), _bits("float32", 0x7F800001, 0xFFC12345)]
    ),
    "float64": np.concatenate([np.array([np.inf, -0.0, 5e-324]), _bits("float64", 0x7FF0000000000001)]),
    "float16": np.concatenate([np.array([-0.0, 6e-8], "float16"), _bits("float16", 0x7E01, 0xFE00, 0x7C01)]),
    "int64": np.array([2**62 + 1, -(2**62)], "int64"),
    "int32": np.array([[7, -7]], "int32"),
    "int16": np.array([-3, 2**14], "int16"),
    "uint8": np.array([255, 0], "uint8"),
    "bool": np.array([True, False]),
    "bfloat16": np.array([1.5, -0.0, np.nan], "float32"),  # Horovod can neither sum nor broadcast it
}


def _broadcast_on_a_rank():
    import horovod.tensorflow as hvd

    from hvd_spark.keras import broadcast_variables, reconcile_variables

    hvd.init()
    mine = hvd.rank() == 0
    variables = [
        keras.Variable(v if mine else np.ones_like(v), dtype=dtype, trainable=False) for dtype, v in _VALUES.items()
    ]
    before = [np.asarray(keras.ops.convert_to_numpy(v)).tobytes().hex() for v in variables]
    broadcast_variables(variables)
    after = [np.asarray(keras.ops.convert_to_numpy(v)).tobytes().hex() for v in variables]
    r = float(hvd.rank())
    differ = [keras.Variable([r], dtype=d, trainable=False) for d in ("float32", "bfloat16", "float16", "int64")]
    same = keras.Variable([-0.0], dtype="float32", trainable=False)
    changed = reconcile_variables([*differ, same])
    averaged = [float(keras.ops.convert_to_numpy(keras.ops.cast(v, "float32"))[0]) for v in differ]
    return before if mine else None, after, changed, averaged, np.asarray(same).tobytes().hex()


def test_rank_zeros_state_reaches_every_rank_bit_for_bit(spark):
    """Every dtype, bit for bit (-0.0, NaN payloads and signs, signaling NaNs, subnormals, the largest ints);
    and state that differs is averaged per dtype (bfloat16 and float16 beside float32), integers taken from
    rank 0, what agrees left as it is."""
    ranks = hvd_spark.run(_broadcast_on_a_rank, num_proc=2, verbose=0)
    before = ranks[0][0]
    assert ranks[0][1] == ranks[1][1] == before
    assert ranks[0][2:] == ranks[1][2:]
    changed, averaged, same = ranks[0][2:]
    assert (changed, averaged, same) == (4, [0.5, 0.5, 0.5, 0.0], np.array([-0.0], "float32").tobytes().hex())
    assert bytes.fromhex(before[0]) == _VALUES["float32"].tobytes()  # the variable holds the bits it was given
    assert bytes.fromhex(before[2]) == _VALUES["float16"].tobytes()


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
    so the epoch's gradient is the same whichever rank reads which row; 24 validation rows, 12 a rank in
    batches of 5 (a last part of 2)."""
    n_train, n_val, epochs = 64, 24, 5
    x, y, df = _pandas_frame(spark, n_train, n_val)
    plain = _model()
    want = plain.fit(
        x[:n_train], y[:n_train], batch_size=2 * 32, epochs=epochs, shuffle=False,
        validation_data=(x[n_train:], y[n_train:]), validation_batch_size=5, verbose=0,
    ).history  # fmt: skip
    est = HorovodEstimator(
        num_proc=2, store=Store(str(tmp_path / "store")), model=_model(), feature_cols=["x"], label_cols=["y"],
        validation="is_val", batch_size=32, val_batch_size=5, epochs=epochs, verbose=0,
    )  # fmt: skip
    fitted = est.fit(df)
    got = fitted.getHistory()
    assert sorted(got) == sorted(want)
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=1e-6, err_msg=f"history[{key!r}]")
    for i, (a, b) in enumerate(zip(fitted.getModel().get_weights(), plain.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
    assert fitted.getFitSummary().steps_per_epoch == 1
