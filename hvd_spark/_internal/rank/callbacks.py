"""The Keras callbacks every rank runs during ``HorovodEstimator.fit``: metrics over all ranks' rows
(their states summed), validation with every row counted once, random streams of their own per rank, and progress
events for the driver."""

import math
import time
from collections.abc import Callable
from typing import Any

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


def sum_metric_states(model, name: str) -> None:
    """Sums every metric state of ``model`` (Keras' totals and counts, confusion matrices, AUC buckets)
    over the ranks, in place: each rank's metrics then hold the states of all ranks' rows, and their
    results are the metrics over all of them. Every rank must call it at the same point."""
    import horovod.tensorflow as hvd

    variables = [v for m in model.metrics for v in m.variables]
    if hvd.size() == 1 or not variables:
        return
    summed = hvd.grouped_allreduce([tf.convert_to_tensor(v.value) for v in variables], op=hvd.Sum, name=name)
    for v, value in zip(variables, summed):
        v.assign(value)


class MetricAverageCallback(keras.callbacks.Callback):
    """Makes each epoch's training logs the metrics over the epoch's rows of all ranks.

    Where Keras reports the model's metrics at the epoch's end (the logs' keys are those of
    ``model.get_metrics_result()``: ``compile``'s loss, metrics and per-output losses, and a custom
    ``train_step`` returning them), their states are summed over the ranks and the results computed
    from the sums, as one process that trained on all the rows reports them (precision, AUC, ... are not
    the mean of the ranks' values). Other logs (a custom ``train_step``'s own values: Keras reports
    their last step) are averaged over the ranks. Put it before validation and before callbacks that
    read the logs (checkpoints, early stopping, progress).
    """

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if logs is None or hvd.size() == 1:
            return
        results = self.model.get_metrics_result()
        exact: dict = {}
        if set(logs) == set(results):  # Keras' own rule (Trainer._get_metrics_result_or_logs)
            sum_metric_states(self.model, "hvd_spark.train_metrics")
            exact = {k: float(v) for k, v in self.model.get_metrics_result().items() if is_number(v)}
        averaged = average_logs({k: v for k, v in logs.items() if k not in exact})
        logs.clear()
        logs.update(averaged)
        logs.update(exact)


class ExactValidationCallback(keras.callbacks.Callback):
    """Validation with every row counted once: at each epoch's end every rank evaluates its own
    validation rows (a single pass, however many batches that is), then the metrics' states (totals
    and counts, confusion matrices ...) are summed over the ranks and the results computed from the
    sums, so ``val_*`` equals one ``evaluate`` of the whole split. Metrics whose state is not additive
    over rows (a custom metric keeping a maximum) are not exact this way; Keras' built-in ones are.

    ``evaluate`` is always given its number of steps: over a dataset of unknown length, Keras 3's
    per-output loss trackers count one step more than there were (``val_<output>_loss`` too low).

    Args:
        dataset: a finite dataset of this rank's validation rows, or None when the rank has none.
        steps: at most this many batches per rank (``validation_steps_per_epoch``), or None: all.
        batches: the number of batches ``dataset`` holds, when known (else counted on first use).
        callbacks: callbacks for the evaluation (progress ticks).
        freq: Keras ``fit``'s ``validation_freq``: every N epochs, or after the listed epochs (1-based).
        keep_bytes: when every validation evaluates all the batches and they can take at most this
            many bytes (``batch_size`` rows each), the first validation reads them into memory and every
            validation evaluates those (:func:`kept_batches`); 0: ``dataset`` is read at each validation.
        batch_size: the rows of a validation batch (the last one may have fewer).
    """

    def __init__(
        self,
        dataset,
        steps: int | None = None,
        callbacks=(),
        *,
        batches: int | None = None,
        freq=1,
        keep_bytes: int = 0,
        batch_size: int = 0,
    ):
        super().__init__()
        self.dataset, self.steps, self.callbacks = dataset, steps, list(callbacks)
        self.batches, self.freq = batches, freq
        self.keep_bytes, self.batch_size = keep_bytes, batch_size
        self.kept: Any = None  # the batches in memory once read (False: they are read at each validation)

    def _due(self, epoch: int) -> bool:
        if isinstance(self.freq, int):
            return (epoch + 1) % self.freq == 0
        return epoch + 1 in self.freq

    def _steps(self) -> int:
        if self.batches is None:
            self.batches = int(self.dataset.reduce(0, lambda n, _: n + 1).numpy())  # once per fit
        return self.batches if self.steps is None else min(self.steps, self.batches)

    def on_epoch_end(self, epoch, logs=None):
        if not self._due(epoch):
            return
        model = self.model
        steps = self._steps() if self.dataset is not None else 0
        if steps:
            model.evaluate(self._source(steps), steps=steps, verbose=0, callbacks=self.callbacks)
        else:
            model.reset_metrics()
        sum_metric_states(model, "hvd_spark.val_metrics")
        results = model.get_metrics_result()
        if logs is not None:
            logs.update({f"val_{k}": float(v) for k, v in results.items() if is_number(v)})
        model.reset_metrics()

    def _source(self, steps: int):
        """What this validation evaluates: the batches kept in memory, else ``dataset``."""
        if self.kept is None and self.keep_bytes and self.batch_size and steps == self.batches:
            self.kept = kept_batches(self.dataset, steps, self.batch_size, self.keep_bytes) or False
        return self.kept or self.dataset  # False: read at each validation


def kept_batches(dataset, steps: int, batch_size: int, budget: int):
    """The first ``steps`` batches of ``dataset`` (of ``batch_size`` rows, the last one maybe fewer) read
    into memory, as a dataset yielding the same batches: the same tensors, in the same order. None, decided
    before anything is read (a reader is never left half read), when they could take more than ``budget``
    bytes (``steps x batch_size`` rows at the row size of ``dataset.element_spec``) or hold other than dense
    numeric tensors of a known row shape; None after reading when their sizes are not whole batches and a
    last part (then each validation reads ``dataset`` as before)."""
    from hvd_spark._internal.rank.reader import sliced, without_autotune_model

    specs = tf.nest.flatten(dataset.element_spec)
    plain = all(
        isinstance(s, tf.TensorSpec) and s.dtype != tf.string and s.shape.rank and s.shape[1:].is_fully_defined()
        for s in specs
    )
    if not plain or steps * batch_size * sum(s.shape[1:].num_elements() * s.dtype.size for s in specs) > budget:
        return None
    batches = list(dataset.take(steps))
    lengths = [int(tf.nest.flatten(b)[0].shape[0]) for b in batches]
    whole = all(n == lengths[0] for n in lengths[:-1]) and 0 < lengths[-1] <= lengths[0]
    if (
        not batches
        or not whole
        or any(int(t.shape[0]) != n for b, n in zip(batches, lengths) for t in tf.nest.flatten(b))
    ):
        return None
    rows = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *batches)
    del batches
    return without_autotune_model(sliced(rows, lengths[0]))  # one slice per batch, as the reader cuts them


class StopAgreementCallback(keras.callbacks.Callback):
    """``model.stop_training`` set on any rank stops every rank together, as one process would stop.

    Keras ends ``fit`` after the step (or epoch) in which a callback set ``model.stop_training``; a rank
    that stopped alone would leave the others waiting in the next allreduce. At each epoch's start and
    end, and after each step when a user callback acts on steps (``batch_hooks``), the ranks agree with
    one allreduce of a flag: any rank's request stops all of them there (a request made at an epoch's
    start, or in ``on_train_begin``, stops every rank after that epoch's first step, as Keras stops one
    process). Put it after the user's callbacks.

    Only callbacks set ``model.stop_training`` (Keras' fit loop never does): without ``batch_hooks``
    (no user callback acts on steps: :func:`acts_on_steps`) there is no agreement after steps, without
    ``begin_hooks`` (:func:`acts_at_epoch_starts`) none at epochs' starts, without ``end_hooks``
    (:func:`acts_at_epoch_ends`) none at their ends: nothing could have asked to stop there. The flags
    must be the same on every rank.
    """

    def __init__(self, batch_hooks: bool, begin_hooks: bool = True, end_hooks: bool = True):
        super().__init__()
        self.batch_hooks, self.begin_hooks, self.end_hooks = batch_hooks, begin_hooks, end_hooks

    def _agree(self) -> None:
        import horovod.tensorflow as hvd

        if hvd.size() == 1:
            return
        flag = tf.constant([1.0 if self.model.stop_training else 0.0], dtype=tf.float32)
        requested = float(hvd.allreduce(flag, op=hvd.Sum, name="hvd_spark.stop_training").numpy()[0])
        if requested > 0 and not self.model.stop_training:
            import logging

            logging.getLogger(__name__).info(
                "%d rank(s) set model.stop_training: every rank stops here", int(requested)
            )
        self.model.stop_training = requested > 0

    def on_train_batch_end(self, batch, logs=None):
        if self.batch_hooks:
            self._agree()

    def on_epoch_begin(self, epoch, logs=None):
        if self.begin_hooks:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        if self.end_hooks:
            self._agree()


def stop_reason(callbacks) -> Callable[[int, dict], str]:
    """What names the callback that stopped training after an epoch: an EarlyStopping whose
    ``stopped_epoch`` is that epoch, a TerminateOnNaN that met a loss that is not finite, else
    ``model.stop_training`` (a callback of the user's own)."""

    def reason(epoch: int, logs: dict) -> str:
        names = [type(cb).__name__ for cb in callbacks if getattr(cb, "stopped_epoch", None) == epoch and epoch]
        if not names and not math.isfinite(float(logs.get("loss", 0.0))):
            names = [type(cb).__name__ for cb in callbacks if isinstance(cb, keras.callbacks.TerminateOnNaN)]
        return ", ".join(names) or "model.stop_training"

    return reason


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
_BEGIN_HOOKS = ("on_train_begin", "on_epoch_begin")
_END_HOOKS = ("on_epoch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end")


def acts_on_steps(callbacks) -> bool:
    """Whether any of ``callbacks`` has code of its own that runs at training steps (where it may set
    ``model.stop_training``): a hook overridden by its class or set on the object (LambdaCallback).
    Keras' own file writers (:data:`FILE_WRITERS`, not subclasses) act on steps but never stop training,
    nor does a callback that says so with ``may_stop_training = False`` (a logger, a timer)."""
    return _acts_on(callbacks, _BATCH_HOOKS)


def acts_at_epoch_starts(callbacks) -> bool:
    """Whether any of ``callbacks`` has code of its own at the start of training or of an epoch, where it
    may set ``model.stop_training``; as :func:`acts_on_steps`. The start hooks of Keras' callbacks in
    :data:`RESET_AT_START` (not subclasses, not hooks set on the object) only reset their state."""
    return _acts_on([cb for cb in callbacks if type(cb) not in RESET_AT_START or _own_hooks(cb)], _BEGIN_HOOKS)


def acts_at_epoch_ends(callbacks) -> bool:
    """Whether any of ``callbacks`` has code of its own at an epoch's end (its validation included), where
    it may set ``model.stop_training`` (EarlyStopping does); as :func:`acts_on_steps`."""
    return _acts_on(callbacks, _END_HOOKS)


def _own_hooks(cb) -> bool:
    """Whether hooks were set on the object itself (a LambdaCallback's, or one patched by the user)."""
    return any(name.startswith("on_") for name in vars(cb))


def _acts_on(callbacks, hooks) -> bool:
    base = keras.callbacks.Callback
    for cb in callbacks:
        if type(cb) in FILE_WRITERS or getattr(cb, "may_stop_training", True) is False:
            continue
        for name in hooks:
            if name in vars(cb) or getattr(type(cb), name, None) is not getattr(base, name):
                return True
    return False


class UpdateCheckCallback(keras.callbacks.Callback):
    """After the first training step and the first epoch, checks that the trainable weights are equal on
    every rank (one allgather of a digest per rank). A ``train_step`` that changes weights without
    ``self.optimizer`` (``apply`` / ``apply_gradients``, where the gradients are averaged) would
    otherwise train every rank apart and fail only when ``fit`` compares the ranks at its end."""

    def __init__(self):
        super().__init__()
        self._checks = 0

    def on_train_batch_end(self, batch, logs=None):
        if self._checks == 0:
            self._check("the first training step")

    def on_epoch_end(self, epoch, logs=None):
        if self._checks == 1:
            self._check("the first epoch")

    def _check(self, when: str) -> None:
        import hashlib

        import horovod.tensorflow as hvd
        import numpy as np

        self._checks += 1
        if hvd.size() == 1:
            return
        h = hashlib.sha256()
        for v in self.model.trainable_weights:
            h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
        mine = np.frombuffer(h.digest(), dtype=np.uint8)
        digests = hvd.allgather(tf.constant(mine[None, :]), name=f"hvd_spark.update_check.{self._checks}").numpy()
        differ = [r for r in range(len(digests)) if not np.array_equal(digests[r], digests[0])]
        if differ:
            raise RuntimeError(
                f"The trainable weights of ranks {differ} differ from rank 0's after {when}: the model's "
                "train_step changed weights without self.optimizer, whose apply / apply_gradients averages the "
                "gradients over the ranks. In train_step, compute the gradients and call "
                "self.optimizer.apply(grads, self.trainable_variables) (or apply_gradients); variables updated "
                "otherwise (statistics, counters) must not be trainable."
            )


# Keras callbacks that write files: on rank 0 only (every rank sees the same averaged logs), where a
# relative path lands in the run's outputs/ folder in the store (OutputsSync).
FILE_WRITERS = (keras.callbacks.TensorBoard, keras.callbacks.CSVLogger, keras.callbacks.ModelCheckpoint)


# Keras callbacks whose start hooks (on_train_begin, on_epoch_begin) only reset their own state.
RESET_AT_START = (
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.History,
    keras.callbacks.ProgbarLogger,
)


def rank_callbacks(callbacks, rank: int) -> list:
    """The user's callbacks that run on ``rank``: all of them on rank 0; on the others, all but
    :data:`FILE_WRITERS` (the same file written by every rank would race, or land on every host)."""
    return [cb for cb in callbacks if rank == 0 or not isinstance(cb, FILE_WRITERS)]


class OutputsSync(keras.callbacks.Callback):
    """Rank 0: copies what its callbacks wrote under ``local`` (its working folder during ``fit``) to
    ``dest`` in the store after every epoch and at the end of training; only new or changed files."""

    def __init__(self, store, local: str, dest: str):
        super().__init__()
        self.store, self.local, self.dest = store, local, dest
        self._seen: dict[str, tuple[int, int]] = {}

    def sync(self) -> int:
        import os
        import posixpath

        copied = 0
        for dirpath, _, files in os.walk(self.local):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # removed meanwhile (a callback's temporary file)
                    continue
                if self._seen.get(path) == (st.st_size, st.st_mtime_ns):
                    continue
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                dest = posixpath.join(self.dest, rel)
                self.store.files.makedirs(posixpath.dirname(dest))
                self.store.files.upload_file(path, dest)
                self._seen[path] = (st.st_size, st.st_mtime_ns)
                copied += 1
        return copied

    def _sync_busy(self) -> None:
        from hvd_spark._internal.common.events import busy

        with busy("copying what callbacks wrote to the store"):  # a large file to an object store: not stalled
            self.sync()

    def on_epoch_end(self, epoch, logs=None):
        self._sync_busy()

    def on_train_end(self, logs=None):
        self._sync_busy()


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
