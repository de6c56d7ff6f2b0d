"""The callbacks a rank adds to the user's in ``model.fit``: where its start went, its step counts, its
first step, TensorBoard without per-batch writes, horovod.spark's best-model checkpoint, and the
run's checkpoints in the store."""

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy
from hvd_spark._internal.rank.callbacks import is_number
from hvd_spark._internal.rank.checkpoints import RunCommits

logger = logging.getLogger(__name__)


class Startup(keras.callbacks.Callback):
    """Where a rank's start went, in seconds per phase: ``process`` (from the task asking for the
    rank's process to ``train``: Python's start and imports for a fresh rank, the wait for its warm
    server and the fork for a warm one; 0 under MPI),
    ``horovod_init``, ``model`` (built or loaded, compiled), ``data`` (readers opened), ``first_step``
    (Keras' tracing of the train step and the step), ``first_epoch`` (the rest of the first epoch, its
    validation and checkpoint); ``warm`` says how it started."""

    def __init__(self, t_entry: float):
        super().__init__()
        created = float(os.environ.get(settings.ENV_RANK_STARTED) or t_entry)  # set by the task (not under MPI)
        self.phases: dict[str, float] = {"process": max(0.0, t_entry - created)}
        self.phases["warm"] = 1.0 if os.environ.get(settings.ENV_WARM_RANK) == "1" else 0.0
        self._last = t_entry

    def mark(self, phase: str) -> None:
        from hvd_spark._internal.common.events import mark_progress

        mark_progress(f"start-up, after {phase}")
        now = time.time()
        self.phases[phase] = now - self._last
        self._last = now

    def on_train_batch_end(self, batch, logs=None):
        if "first_step" not in self.phases:
            self.mark("first_step")

    def on_epoch_end(self, epoch, logs=None):
        if "first_epoch" not in self.phases:
            self.mark("first_epoch")


class Ticks(keras.callbacks.Callback):
    """Progress for the stall watchdog (``stall_timeout``): a tick per step, validation step and
    epoch boundary, naming where the rank is."""

    def __init__(self):
        super().__init__()
        from hvd_spark._internal.common.events import mark_progress

        self._tick = mark_progress
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._tick(f"the start of epoch {self._epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self._tick(f"epoch {self._epoch} step {batch + 1}")

    def on_test_batch_end(self, batch, logs=None):
        from hvd_spark._internal.common.events import keep_alive

        keep_alive(f"epoch {self._epoch} validation step {batch + 1}")  # alive; not a step ahead of a peer

    def on_epoch_end(self, epoch, logs=None):
        self._tick(f"the end of epoch {epoch + 1}")


class FirstStep(keras.callbacks.Callback):
    """A rank's first training step (Keras traces and compiles the train step, which can take minutes
    for a large model) counts as progress for the stall watchdog, up to ``FIRST_STEP_TIMEOUT``."""

    def __init__(self):
        super().__init__()
        self._busy = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._busy is None:
            self._busy = busy("the first training step (tracing)", limit=settings.FIRST_STEP_TIMEOUT.get())
            self._busy.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._busy is not None and self._busy is not False:
            self._busy.__exit__(None, None, None)
            self._busy = False

    def on_train_end(self, logs=None):
        self.on_train_batch_end(0)


def best_checkpoint(cfg: RunConfig, tmp: str):
    """horovod.spark's ``checkpoint_callback`` (a ModelCheckpoint), writing to this rank's temporary
    folder; its last file becomes the model fit returns. None when not given."""
    if not cfg.training.checkpoint_callback:
        return None
    import cloudpickle

    cb = cloudpickle.loads(cfg.training.checkpoint_callback)
    cb.filepath = os.path.join(tmp, "best.weights.h5" if cb.save_weights_only else "best.keras")
    return cb


def tensorboard(store, run_id: str, tmp: str):
    class _TB(keras.callbacks.TensorBoard):
        """TensorBoard logs written locally and copied to the run's logs folder after each epoch."""

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)  # written and flushed (TF flushes a writer leaving as_default)
            with busy("uploading TensorBoard logs"):
                store.files.upload_dir(local, store.logs_path(run_id))

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            store.files.upload_dir(local, store.logs_path(run_id))

        def on_train_batch_begin(self, batch, logs=None):
            self._global_train_batch += 1  # Keras' count; no profiling (profile_batch=0)

        def on_train_batch_end(self, batch, logs=None):
            """Nothing: the logs are written per epoch. Keras 3's TensorBoard calls ``tf.summary.scalar``
            for every log after every batch whatever its ``update_freq`` (writing nothing with no
            default writer), about 10% of a rank's time at 128 rows per step."""

    local = os.path.join(tmp, "logs")
    return _TB(log_dir=local, write_graph=False, profile_batch=0, update_freq="epoch")


class CheckpointCallback(keras.callbacks.Callback):
    """Rank 0: after each epoch, the model (weights, optimizer state, epoch, metrics) to the store;
    with ``every_steps`` or ``every_seconds``, also commits inside an epoch, each recording the data
    cursor (``data.cursor``: which positions every rank has read) and the optimizer's step count.

    The ``.keras`` file is uploaded first and the ``.json`` after it, each atomically; a
    checkpoint counts as complete once its JSON exists, so a crash while committing leaves the
    previous one the latest. A complete checkpoint removes the commits before it. Before writing,
    the run's writer lease must still be this fit's (``lease``: its path and token) and the
    checkpoint must not exist: a fit that lost its run to another (a stalled or cancelled one) stops
    with ``RunInUseError`` instead of writing into it, and a run never holds more epochs than asked.
    An epoch after which the callbacks stopped training (EarlyStopping, TerminateOnNaN, the user's
    ``model.stop_training``) is recorded as the run's stop (``stopped``; ``data/stops.py``).
    Commits fall on multiples of ``step_multiple`` steps (``backward_passes_per_step``: never between
    the batches of one update). ``keep`` (``keep_checkpoints``): after each epoch checkpoint, only the
    newest ``keep`` epoch checkpoints stay, and the one this fit resumed from (``kept_from``).
    """

    def __init__(
        self,
        store,
        run_id: str,
        history_so_far: Sequence[dict],
        tmp: str,
        lease: tuple[str, str] | None = None,
        epochs: int | None = None,
        *,
        data=None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        step_multiple: int = 1,
        stop_reason: Callable[[int, dict], str] | None = None,
        callback_states: Callable[[], list] | None = None,
        keep: int | None = None,
        kept_from: int | None = None,
    ):
        super().__init__()
        self.callback_states = callback_states  # the user's stateful callbacks' state (rank/carried.py)
        self.stop_reason = stop_reason  # which callback stopped training at an epoch (recorded with its checkpoint)
        self.stopped: dict[str, Any] | None = None  # the early stop this fit recorded
        self.store, self.run_id, self.tmp = store, run_id, tmp
        self.lease, self.epochs = lease, epochs
        self.history: list[dict] = [dict(h) for h in history_so_far]
        self.data, self.every_steps, self.every_seconds = data, every_steps, every_seconds
        self.step_multiple = max(1, step_multiple)
        self.keep, self.kept_from = keep, kept_from
        self.commits = RunCommits(store, run_id, tmp, lease, epochs, keep=keep, kept_from=kept_from)
        self.segment: Any = None  # the rank/cursor.Segment being trained: set by train() before each model.fit
        self._epoch = 0
        self._last_commit = time.monotonic()

    def _write(self, epoch: int, step: int, meta: dict) -> None:
        """The checkpoint after ``epoch`` epochs and ``step`` steps of the next one (``checkpoints.RunCommits``)."""
        from hvd_spark._internal.common.serde import save_model_file

        if self.callback_states is not None:
            meta = dict(meta, callbacks=self.callback_states())
        iterations = int(self.model.optimizer.iterations.numpy())
        self.commits.write(epoch, step, meta, lambda local: save_model_file(self.model, local), iterations)
        self._last_commit = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.data is None or self.segment is None or (self.every_steps is None and self.every_seconds is None):
            return
        seg, done = self.segment, batch + 1
        in_epoch = (seg.steps_before if self._epoch == seg.first else 0) + done
        if done >= seg.steps:
            return  # the epoch's last step is an epoch checkpoint
        if self.step_multiple > 1 and int(self.model.optimizer.iterations.numpy()) % self.step_multiple:
            return  # never inside a gradient accumulation (it runs on the optimizer's step count)
        due = (self.every_steps is not None and in_epoch % self.every_steps == 0) or (
            self.every_seconds is not None and time.monotonic() - self._last_commit >= self.every_seconds
        )
        if not due:
            return
        cursor = self.data.cursor(seg, self._epoch, done)
        self._write(
            self._epoch, in_epoch, {"logs": {}, "history": self.history[: self._epoch], "cursor": cursor.to_json()}
        )

    def on_epoch_end(self, epoch, logs=None):
        logs = {k: float(v) for k, v in (logs or {}).items() if is_number(v)}
        self.history = self.history[:epoch] + [logs]
        meta: dict[str, Any] = {"logs": logs, "history": self.history}
        if self.model.stop_training:  # the ranks agreed on it (StopAgreementCallback); a resize's stop comes later
            by = self.stop_reason(epoch, logs) if self.stop_reason is not None else "model.stop_training"
            self.stopped = meta["stopped"] = {"epoch": epoch + 1, "epochs": self.epochs, "by": by}
        self._write(epoch + 1, 0, meta)
