"""Non-trainable state (BatchNormalization, custom layers) on several ranks: 2 real Horovod ranks over Gloo.

Gradient averaging keeps trainable weights identical; state that layers update in their
forward pass is brought into agreement by hvd_spark (averaged), or, with
``BatchNormalization(synchronized=True)``, computed over the global batch on every step.
"""

import os
import sys

import cloudpickle
import keras
import numpy as np
import pytest

import hvd_spark
from hvd_spark import HorovodEstimator, Store

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from digits import digits_frames  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the custom layer travels to the ranks by value


@keras.saving.register_keras_serializable(package="hvd_spark_tests")
class RunningCenter(keras.layers.Layer):
    """Subtracts a running mean of its inputs, kept in non-trainable weights (a float mean and an int count)."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="mean")
        self.seen = self.add_weight(shape=(), initializer="zeros", dtype="int64", trainable=False, name="seen")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.8 * self.mean + 0.2 * keras.ops.mean(x, axis=0))
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "int64"))
        return x - self.mean


@pytest.fixture(scope="module")
def digits(spark):
    train, test = digits_frames(spark)
    return train.cache(), test.cache()


def _bn_model():
    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Flatten()(x)
    x = RunningCenter()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


def test_batchnorm_and_custom_state_train_on_two_ranks(digits, tmp_path):
    keras.utils.set_random_seed(3)
    store = str(tmp_path / "store")
    est = HorovodEstimator(
        num_proc=2,
        store=store,
        model=_bn_model(),
        optimizer=keras.optimizers.Adam(0.005),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],  # RunningCenter is found through Keras' registry
        label_cols=["label"],
        validation=0.2,
        batch_size=32,
        epochs=3,
        run_id="bn",
    )
    fitted = est.fit(digits[0])
    ranks = fitted.getFitSummary().ranks
    # The ranks' moving statistics had diverged and were averaged: bit-identical weights at the end.
    assert len({r.weights_digest for r in ranks}) == 1
    assert all(r.state_reconciled > 0 for r in ranks)

    # The saved model (plain Keras, fresh load) predicts what transform() predicts.
    s = Store(store)
    saved = keras.models.load_model(s.model_path("bn"), custom_objects={"RunningCenter": RunningCenter})
    rows = digits[1].toPandas()
    x = np.stack(rows["features"].to_numpy()).reshape(-1, 8, 8, 1).astype("float32")
    expected = saved.predict(x, verbose=0)
    scored = fitted.transform(digits[1]).select("label__output").toPandas()
    got = np.stack(scored["label__output"].to_numpy())
    np.testing.assert_allclose(got, expected, atol=1e-5)
    accuracy = float((got.argmax(1) == rows["label"].to_numpy()).mean())
    assert accuracy >= 0.85, f"held-out accuracy {accuracy:.3f}"

    # Every checkpoint holds the agreed statistics: the last one equals the final model.
    ckpt = s.latest_checkpoint("bn").model_path
    last = keras.models.load_model(ckpt, custom_objects={"RunningCenter": RunningCenter})
    for a, b in zip(last.non_trainable_weights, saved.non_trainable_weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moving_var = [np.asarray(w) for w in saved.non_trainable_weights if "moving_variance" in w.path]
    assert moving_var and all((v > 0).all() and not np.allclose(v, 1.0) for v in moving_var)  # really updated


def sync_bn_job(synchronized):
    """Rank 0 sees data around 0, rank 1 around 10: BN statistics tell local from global batches."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    from hvd_spark.keras import BroadcastStateCallback, make_distributed, synchronize_batch_norm

    hvd.init()

    def model(sync):
        keras.utils.set_random_seed(5)
        m = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4),
                keras.layers.BatchNormalization(momentum=0.0, synchronized=sync),
                keras.layers.Dense(1),
            ]
        )
        return m

    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 1, size=(16, 3)).astype("float32"), rng.normal(10, 1, size=(16, 3)).astype("float32")]
    ys = [rng.normal(size=(16, 1)).astype("float32") for _ in range(2)]
    m = model(synchronized)
    opt = make_distributed(keras.optimizers.SGD(0.01))
    m.compile(optimizer=opt, loss="mse")
    changed = synchronize_batch_norm(m)
    m.fit(
        xs[hvd.rank()],
        ys[hvd.rank()],
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastStateCallback()],
    )
    out = {
        "changed": changed,
        "moving_mean": np.asarray(m.layers[1].moving_mean).tolist(),
        "weights": [w.tolist() for w in m.get_weights()],
    }
    if hvd.rank() == 0:
        # The reference: one process, plain BatchNormalization, the global batch of 32 rows.
        ref = model(False)
        ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        ref.fit(np.concatenate(xs), np.concatenate(ys), batch_size=32, epochs=2, shuffle=False, verbose=0)
        out["reference"] = [w.tolist() for w in ref.get_weights()]
        out["reference_mean"] = np.asarray(ref.layers[1].moving_mean).tolist()
    return out


def test_synchronized_batchnorm_uses_the_global_batch(spark):
    r0, r1 = hvd_spark.run(sync_bn_job, args=(True,), num_proc=2, spark=spark, verbose=0)
    assert r0["changed"] == r1["changed"] == 1
    # Two steps of SGD on 2 ranks with global statistics == one process on the concatenated batch.
    for got, want in zip(r0["weights"], r0["reference"]):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    for a, b in zip(r0["weights"], r1["weights"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))

    # Without synchronized=True each rank normalizes by its own batch: its statistics differ from the global ones.
    u0, u1 = hvd_spark.run(sync_bn_job, args=(False,), num_proc=2, spark=spark, verbose=0)
    assert u0["changed"] == 0
    assert not np.allclose(u0["moving_mean"], u1["moving_mean"], atol=1.0)
    assert not np.allclose(u0["moving_mean"], u0["reference_mean"], atol=1.0)
