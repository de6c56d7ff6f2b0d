"""Keras 3 + Horovod glue: gradient averaging, state broadcast, metric averaging, progress.

``horovod.tensorflow.keras`` does not work with Keras 3 (its optimizer wrapper and
``broadcast_variables`` touch ``Variable.ref``, which Keras 3 variables lack). What works,
and is used here: an optimizer that averages the gradients of each update with
``hvd.grouped_allreduce`` (:func:`make_distributed`), and broadcasts through each Keras variable's backing TF variable.
"""

import contextlib
import time
from typing import Any

import keras
import tensorflow as tf

_DIST_ATTR = "_hvd_spark_base_class"


def make_distributed(
    optimizer: keras.optimizers.Optimizer, *, compression: str = "none", backward_passes_per_step: int = 1
):
    """Makes ``optimizer`` average its gradients over all Horovod ranks before applying them.

    The instance keeps its state and configuration; only its class is swapped for a subclass
    with the same name and module that allreduces the gradients of every update. Use
    :func:`plain_class` while saving, so that the saved file names the original class and
    loads anywhere (Keras cannot find a class made at run time).

    The allreduce sits where Keras takes the gradients of an update, before clipping: once per
    step, or with gradient accumulation (Keras' ``gradient_accumulation_steps``, which
    ``backward_passes_per_step`` sets) once per ``N`` batches, on their average, so a step that
    only accumulates costs no communication. Wrapping optimizers (``LossScaleOptimizer``) are
    averaged before their own checks instead, on every step (every rank must take the same branch).

    Args:
        optimizer: a Keras 3 optimizer (built or not).
        compression: ``"none"`` or ``"fp16"`` (gradients sent as float16).
        backward_passes_per_step: batches whose gradients are accumulated locally and averaged
            once (Horovod's name; equivalent to a batch ``N`` times larger). 1: every batch.

    Returns:
        The same optimizer object.
    """
    import horovod.tensorflow as hvd

    if getattr(optimizer, _DIST_ATTR, None) is not None:
        return optimizer
    if compression not in ("none", "fp16"):
        raise ValueError(f"compression must be 'none' or 'fp16'. Received: {compression!r}.")
    set_accumulation(optimizer, backward_passes_per_step)
    base = type(optimizer)
    comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none

    def average(grads):
        if hvd.size() == 1:
            return grads
        grads = list(grads)
        idx = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]  # IndexedSlices -> dense
        if dense:
            reduced = hvd.grouped_allreduce(dense, op=hvd.Average, compression=comp)
            for i, g in zip(idx, reduced):
                grads[i] = g
        return grads

    if hasattr(optimizer, "inner_optimizer"):

        def apply(self, grads, trainable_variables=None):
            return base.apply(self, average(grads), trainable_variables)

        hooks: dict[str, Any] = {"apply": apply}
    else:

        def _clip_gradients(self, grads):
            return base._clip_gradients(self, average(grads))

        hooks = {"_clip_gradients": _clip_gradients}
    dist = type(base.__name__, (base,), {**hooks, "__module__": base.__module__, "__qualname__": base.__qualname__})
    optimizer.__class__ = dist
    setattr(optimizer, _DIST_ATTR, base)
    return optimizer


def set_accumulation(optimizer, steps: int) -> None:
    """Accumulates gradients over ``steps`` batches (Keras' ``gradient_accumulation_steps``).

    An optimizer that already accumulates keeps its own setting when ``steps`` is 1; a built one
    (resumed from a checkpoint) has its accumulators already and cannot change their number."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1. Received: {steps!r}.")
    current = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    if steps == 1 or steps == current:
        return
    if hasattr(optimizer, "inner_optimizer"):
        raise ValueError(
            f"backward_passes_per_step={steps} needs a plain Keras optimizer; {type(optimizer).__name__} wraps "
            "another one: set gradient_accumulation_steps on the inner optimizer instead."
        )
    if optimizer.built:
        raise ValueError(
            f"backward_passes_per_step={steps}, but the optimizer was built with gradient_accumulation_steps="
            f"{current} (a run resumed from a checkpoint keeps the setting it started with)."
        )
    optimizer.gradient_accumulation_steps = steps


@contextlib.contextmanager
def plain_class(optimizer):
    """Within the block, ``optimizer`` is an instance of its original class (for saving)."""
    base = getattr(optimizer, _DIST_ATTR, None) if optimizer is not None else None
    if base is None:
        yield optimizer
        return
    dist = type(optimizer)
    optimizer.__class__ = base
    try:
        yield optimizer
    finally:
        optimizer.__class__ = dist


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Sets every variable to its value on ``root_rank`` (Keras 3 variables included)."""
    import horovod.tensorflow as hvd

    for v in variables:
        value = v.value if hasattr(v, "value") else v
        v.assign(
            hvd.broadcast(
                tf.convert_to_tensor(value),
                root_rank=root_rank,
                name=f"bcast.{v.path if hasattr(v, 'path') else v.name}".replace(":", "_"),
            )
        )


def reconcile_variables(variables, *, name: str = "state") -> int:
    """Brings variables whose values differ between ranks into agreement; returns how many differed.

    Each rank hashes every variable; the hashes are allgathered, so every rank sees the same
    list of variables that differ. Floating-point ones are averaged over the ranks (one grouped
    allreduce), others (integer counters) take rank 0's value. Variables that already agree,
    e.g. frozen layers, are left bit-for-bit as they are.
    """
    import hashlib

    import horovod.tensorflow as hvd
    import numpy as np

    variables = list(variables)
    if hvd.size() == 1 or not variables:
        return 0
    digests = np.array(
        [
            [
                int.from_bytes(
                    hashlib.blake2b(np.ascontiguousarray(np.asarray(v)).tobytes(), digest_size=7).digest(), "little"
                )
                for v in variables
            ]
        ],
        dtype=np.int64,
    )
    gathered = hvd.allgather(tf.constant(digests), name=f"hvd_spark.{name}.digests").numpy()
    differ = [variables[i] for i in range(len(variables)) if (gathered[:, i] != gathered[0, i]).any()]
    floats = [v for v in differ if keras.backend.standardize_dtype(v.dtype).startswith(("float", "bfloat"))]
    if floats:
        averaged = hvd.grouped_allreduce([tf.convert_to_tensor(v.value) for v in floats], op=hvd.Average)
        for v, value in zip(floats, averaged):
            v.assign(value)
    others = [v for v in differ if not any(v is f for f in floats)]
    if others:
        broadcast_variables(others)
    return len(differ)


class StateAgreementCallback(keras.callbacks.Callback):
    """Averages the non-trainable state that each rank updates from its own batches.

    Gradients are averaged, so trainable weights agree after every step; state that layers
    update in their forward pass (BatchNormalization's moving mean and variance, a custom
    layer's ``add_weight(trainable=False)``) does not. This brings it into agreement before
    every validation run inside ``fit`` and at every epoch end (so before checkpoints,
    user callbacks and the final save). Between those points ranks keep their own running
    statistics; with ``BatchNormalization(synchronized=True)`` they agree on every step instead
    (see :func:`synchronize_batch_norm`). Put it before callbacks that save the model.
    """

    def __init__(self):
        super().__init__()
        self._in_fit = False
        self.reconciled = 0

    def _reconcile(self):
        self.reconciled += reconcile_variables(self.model.non_trainable_weights, name="non_trainable")

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_test_begin(self, logs=None):
        if self._in_fit:  # the validation run of fit(): every rank runs it at the same point
            self._reconcile()

    def on_epoch_end(self, epoch, logs=None):
        self._reconcile()

    def on_train_end(self, logs=None):
        self._in_fit = False


def synchronize_batch_norm(model) -> int:
    """Makes every ``BatchNormalization(synchronized=True)`` layer of ``model`` compute its batch
    statistics over the global batch of all Horovod ranks; returns how many layers it changed.

    Keras implements ``synchronized=True`` through ``tf.distribute`` replica contexts, which
    Horovod does not use; without this, such layers silently normalize by the rank's own batch.
    Here each training step sums (count, sum, sum of squares) over the ranks with one allreduce
    per layer, whose gradient is an allreduce too, as in Horovod's and PyTorch's SyncBatchNorm.
    Inference (``training=False``) uses the moving statistics and no collective.
    """
    import types

    changed = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False):
            layer._moments = types.MethodType(_global_moments, layer)
            changed += 1
    return changed


def _global_moments(layer, inputs, mask):
    """Mean and variance over the reduction axes of all ranks' batches (see synchronize_batch_norm)."""
    import horovod.tensorflow as hvd

    x = tf.convert_to_tensor(inputs)
    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
    axes = layer._reduction_axes
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    local = tf.stack(
        [tf.reduce_sum(weights, axes), tf.reduce_sum(x * weights, axes), tf.reduce_sum(tf.square(x) * weights, axes)]
    )
    count, total, squares = tf.unstack(hvd.allreduce(local, op=hvd.Sum))
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    return tf.cast(mean, dtype), tf.cast(variance, dtype)


def average_logs(logs: dict[str, float]) -> dict[str, float]:
    """Averages scalar metrics over the ranks; every rank must call it with the same keys."""
    import horovod.tensorflow as hvd

    if not logs or hvd.size() == 1:
        return dict(logs or {})
    keys = sorted(k for k, v in logs.items() if _is_number(v))
    values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
    averaged = hvd.allreduce(values, op=hvd.Average, name="hvd_spark.metrics").numpy()
    out = dict(logs)
    out.update({k: float(v) for k, v in zip(keys, averaged)})
    return out


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


class BroadcastStateCallback(keras.callbacks.Callback):
    """At the start of training, copies rank 0's weights and optimizer state to every rank."""

    def on_train_begin(self, logs=None):
        model = self.model
        opt = model.optimizer
        if opt is not None and not opt.built:
            opt.build(model.trainable_variables)
        broadcast_variables(model.variables)
        if opt is not None:
            broadcast_variables(opt.variables)


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
        from keras.src.backend.common import global_state

        generators = [v for v in self.model.variables if v.name == "seed_generator_state"]
        global_gen = global_state.get_global_attribute("global_seed_generator")
        if global_gen is not None:
            generators.append(global_gen.state)
        for v, state in zip(generators, seed_states(self.seed, self.rank, epoch, len(generators))):
            v.assign(np.asarray(state, dtype=keras.backend.standardize_dtype(v.dtype)))
        mixed = seed_states(self.seed, self.rank, epoch, 1)[0]
        random.seed(mixed[0])
        np.random.seed(mixed[1] % (2**32))


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
            logs.update({f"val_{k}": float(v) for k, v in results.items() if _is_number(v)})
        model.reset_metrics()


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
                "logs": {k: float(v) for k, v in (logs or {}).items() if _is_number(v)},
            }
        )

    def on_epoch_end(self, epoch, logs=None):
        self._send(
            {
                "kind": "epoch",
                "epoch": epoch + 1,
                "epochs": self.total_epochs,
                "logs": {k: float(v) for k, v in (logs or {}).items() if _is_number(v)},
            }
        )


def history_from(logs_per_epoch: list[dict[str, float]]) -> dict[str, list[float]]:
    """Turns a list of per-epoch logs into Keras' ``History.history`` layout."""
    history: dict[str, list[float]] = {}
    for logs in logs_per_epoch:
        for k, v in logs.items():
            history.setdefault(k, []).append(float(v))
    return history


def set_threads(num_threads: int | None) -> None:
    """Applies the rank's thread budget to TensorFlow (before any op runs)."""
    if not num_threads:
        return
    # RuntimeError: TF is already initialized; the environment variables the launcher set applied instead.
    with contextlib.suppress(RuntimeError):
        tf.config.threading.set_intra_op_parallelism_threads(int(num_threads))
        tf.config.threading.set_inter_op_parallelism_threads(max(1, int(num_threads)))
