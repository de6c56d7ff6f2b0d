"""Per-step work a rank adds to Keras' own (issue 38: a rank's step against plain Keras' step).

The TensorBoard callback every rank 0 runs writes its logs per epoch; Keras 3's own callback calls
``tf.summary.scalar`` for every log after every batch whatever its ``update_freq`` (about 10% of a
rank's time at 128 rows a step, seen with py-spy). No timing here: the calls are counted."""

import keras
import numpy as np

from hvd_spark._internal.data.store import Store
from hvd_spark._internal.rank.fit_callbacks import tensorboard


class _CountingSummary:
    def __init__(self, real):
        self.real, self.scalars = real, 0

    def scalar(self, *args, **kwargs):
        self.scalars += 1
        return self.real.scalar(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _batches(cb, model, steps: int) -> int:
    cb.set_model(model)
    cb._summary_module = counting = _CountingSummary(cb.summary)  # what Keras' `summary` property returns
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    for b in range(steps):
        cb.on_train_batch_begin(b)
        cb.on_train_batch_end(b, {"loss": np.float32(0.5), "accuracy": np.float32(0.7)})
    per_batch = counting.scalars
    cb.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.7})
    cb.on_train_end()
    assert counting.scalars > per_batch  # the epoch's logs are written
    return per_batch


def test_the_ranks_tensorboard_writes_nothing_per_batch(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    keras_own = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "keras"), write_graph=False, profile_batch=0)
    assert _batches(keras_own, model, 5) == 10  # Keras: 2 logs x 5 batches, with update_freq="epoch"
    store = Store(str(tmp_path / "store"))
    ours = tensorboard(store, "r", str(tmp_path / "tmp"))
    assert ours.update_freq == "epoch"
    assert _batches(ours, model, 5) == 0
    assert ours._global_train_batch == 5  # Keras' own count kept
    assert store.files.exists(store.logs_path("r"))  # and the epoch's logs uploaded
