"""The Keras callbacks every rank runs during ``HorovodEstimator.fit``: metrics averaged over the
ranks, validation with every row counted once, random streams of their own per rank, and progress
events for the driver."""

import time

import keras
import tensorflow as tf

from hvd_spark._internal.common import internals


def is_number(v) -> bool:
    """Whether ``v`` converts to a float (a metric value that travels in logs and events)."""
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def average_logs(logs: dict[str, float]) -> dict[str, float]:
    """Averages scalar metrics over the ranks; every rank must call it with the same keys."""
    import horovod.tensorflow as hvd

    if not logs or hvd.size() == 1:
        return dict(logs or {})
    keys = sorted(k for k, v in logs.items() if is_number(v))
    values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
    averaged = hvd.allreduce(values, op=hvd.Average, name="hvd_spark.metrics").numpy()
    out = dict(logs)
    out.update({k: float(v) for k, v in zip(keys, averaged)})
    return out


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's logs (train and validation) by their average over the ranks.

    Put it before callbacks that read the logs (checkpoints, early stopping, progress).
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        averaged = average_logs(logs)
        logs.clear()
        logs.update(averaged)


class ExactValidationCallback(keras.callbacks.Callback):
    """Validation with every row counted once: at each epoch's end every rank evaluates its own
    validation rows (a single pass, however many batches that is), then the metrics' states (totals
    and counts, confusion matrices ...) are summed over the ranks and the results computed from the
    sums, so ``val_*`` equals one ``evaluate`` of the whole split. Metrics whose state is not additive
    over rows (a custom metric keeping a maximum) are not exact this way; Keras' built-in ones are.

    Args:
        dataset: a finite dataset of this rank's validation rows, or None when the rank has none.
        steps: at most this many batches per rank (``validation_steps_per_epoch``), or None: all.
        callbacks: callbacks for the evaluation (progress ticks).
    """

    def __init__(self, dataset, steps: int | None = None, callbacks=()):
        super().__init__()
        self.dataset, self.steps, self.callbacks = dataset, steps, list(callbacks)

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        model = self.model
        if self.dataset is not None:
            model.evaluate(self.dataset, steps=self.steps, verbose=0, callbacks=self.callbacks)
        else:
            model.reset_metrics()
        variables = [v for m in model.metrics for v in m.variables]
        if hvd.size() > 1 and variables:
            summed = hvd.grouped_allreduce(
                [tf.convert_to_tensor(v.value) for v in variables], op=hvd.Sum, name="hvd_spark.val_metrics"
            )
            for v, value in zip(variables, summed):
                v.assign(value)
        results = model.get_metrics_result()
        if logs is not None:
            logs.update({f"val_{k}": float(v) for k, v in results.items() if is_number(v)})
        model.reset_metrics()


def seed_states(seed: int, rank: int, epoch: int, count: int) -> list[list[int]]:
    """The states of ``count`` Keras seed generators for ``rank`` in ``epoch``: distinct per rank (so
    Dropout masks and noise differ between ranks), per epoch (a resumed run continues where an
    uninterrupted one would be, instead of replaying the first epoch's masks), and the same for the
    same seed (two fits with the same seed and ``num_proc`` draw the same numbers)."""
    import numpy as np

    words = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank), int(epoch), 0x5EED]).generate_state(
        2 * max(count, 1), dtype=np.uint32
    )
    return [[int(words[2 * i]) >> 1, int(words[2 * i + 1]) >> 1] for i in range(count)]  # int64-safe, >= 0


class RankRandomnessCallback(keras.callbacks.Callback):
    """Gives every rank its own random streams after the start-of-training broadcast (which copies
    rank 0's seed generators to all ranks): at the start of each epoch, every Keras seed generator of
    the model (Dropout, noise and augmentation layers) and the global one, and Python's and NumPy's
    generators, get states derived from (seed, rank, epoch). Put it after BroadcastStateCallback."""

    def __init__(self, seed: int, rank: int):
        super().__init__()
        self.seed, self.rank = seed, rank

    def on_epoch_begin(self, epoch, logs=None):
        import random

        import numpy as np

        generators = [v for v in self.model.variables if v.name == "seed_generator_state"]
        global_state = internals.global_seed_generator_state()
        if global_state is not None:
            generators.append(global_state)
        for v, state in zip(generators, seed_states(self.seed, self.rank, epoch, len(generators))):
            v.assign(np.asarray(state, dtype=keras.backend.standardize_dtype(v.dtype)))
        mixed = seed_states(self.seed, self.rank, epoch, 1)[0]
        random.seed(mixed[0])
        np.random.seed(mixed[1] % (2**32))


class EventCallback(keras.callbacks.Callback):
    """Sends progress to the driver (rank 0 only): each epoch's (averaged) metrics and, when
    ``batch_interval`` > 0, the position within the epoch at most once per ``batch_interval`` seconds
    (and at the epoch's last step), with rank 0's running metrics."""

    def __init__(self, total_epochs: int, send, steps_per_epoch: int | None = None, batch_interval: float = 0.0):
        super().__init__()
        self.total_epochs = total_epochs
        self.steps = steps_per_epoch
        self.batch_interval = batch_interval
        self._send = send
        self._epoch = 0
        self._last = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._last = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        if self.batch_interval <= 0:
            return
        now, last_step = time.monotonic(), self.steps is not None and batch + 1 >= self.steps
        if now - self._last < self.batch_interval and not last_step:
            return
        self._last = now
        self._send(
            {
                "kind": "batch",
                "epoch": self._epoch,
                "epochs": self.total_epochs,
                "step": batch + 1,
                "steps": self.steps,
                "logs": {k: float(v) for k, v in (logs or {}).items() if is_number(v)},
            }
        )

    def on_epoch_end(self, epoch, logs=None):
        self._send(
            {
                "kind": "epoch",
                "epoch": epoch + 1,
                "epochs": self.total_epochs,
                "logs": {k: float(v) for k, v in (logs or {}).items() if is_number(v)},
            }
        )
