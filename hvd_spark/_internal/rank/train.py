"""What each rank runs during ``HorovodEstimator.fit``: Keras 3 ``model.fit`` with Horovod.

The fit's backend (``ml/backend.py``; by default one Spark barrier stage) calls :func:`train` on
every rank with one plain-data config; this module never imports pyspark.
"""

import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Sequence

import keras

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.rank.callbacks import is_number

logger = logging.getLogger(__name__)


def _weights_digest(model) -> str:
    import numpy as np

    h = hashlib.sha256()
    for v in model.weights:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()


def _rank_seed(seed: int, rank: int) -> int:
    """The data-order seed of ``rank``: distinct for every (seed, rank) pair."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank), 0xDA7A]).generate_state(1)[0])


def _build_model(cfg: RunConfig, custom_objects):
    """The model to train: the latest checkpoint when resuming, else the user's model (compiled)."""
    from hvd_spark._internal.common.serde import load_model_file, loads_keras_obj, model_from_bytes
    from hvd_spark._internal.data.store import Store

    if cfg.resume_ckpt:
        store = Store.from_config(cfg.store)
        # Weights, optimizer state (its step counter included) and compile config, as saved.
        return load_model_file(
            store._url(cfg.resume_ckpt), custom_objects, compile=True, storage_options=store.storage_options
        )
    if cfg.model_bytes is None:
        raise ValueError("The run configuration has neither a checkpoint to resume nor the model to start from.")
    model = model_from_bytes(cfg.model_bytes, custom_objects=custom_objects, compile=True)
    comp = cfg.compile
    if any(comp.get(k) is not None for k in ("optimizer", "loss", "metrics", "loss_weights")) or not getattr(
        model, "compiled", False
    ):
        optimizer = loads_keras_obj(comp["optimizer"], custom_objects) if comp.get("optimizer") else None
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        loss = loads_keras_obj(comp["loss"], custom_objects) if comp.get("loss") else None
        metrics = loads_keras_obj(comp["metrics"], custom_objects) if comp.get("metrics") else None
        weights = comp.get("loss_weights")
        model.compile(
            optimizer=optimizer or model.optimizer,
            loss=loss or model.loss,
            metrics=metrics if metrics is not None else _compiled_metrics(model),
            loss_weights=weights if weights is not None else getattr(model, "loss_weights", None),
        )
    return model


def _compiled_metrics(model):
    cfg = model.get_compile_config() if hasattr(model, "get_compile_config") else None
    return (cfg or {}).get("metrics")


def train(cfg: RunConfig) -> dict:
    """Trains on this rank's files; returns the final weights' digest (and, on rank 0, the history)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    t_entry = time.time()
    import cloudpickle
    import horovod.tensorflow as hvd

    from hvd_spark._internal.common.events import mark_progress
    from hvd_spark._internal.rank.threads import set_threads

    startup = _Startup(t_entry)
    mark_progress("hvd.init()")
    hvd.init()
    startup.mark("horovod_init")
    set_threads(cfg.num_threads)

    from hvd_spark._internal.common.events import send_event
    from hvd_spark._internal.data.store import Store
    from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm
    from hvd_spark._internal.rank.callbacks import (
        EventCallback,
        ExactValidationCallback,
        MetricAverageCallback,
        RankRandomnessCallback,
    )
    from hvd_spark._internal.rank.optimizer import make_distributed
    from hvd_spark._internal.rank.reader import rank_dataset
    from hvd_spark._internal.rank.state import BroadcastStateCallback, StateAgreementCallback

    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(cfg.seed)
    custom_objects = cloudpickle.loads(cfg.custom_objects) if cfg.custom_objects else None
    model = _build_model(cfg, custom_objects)
    if cfg.compile.get("learning_rate") is not None:
        model.optimizer.learning_rate = float(cfg.compile["learning_rate"])  # the fit's own, also after a resume
    make_distributed(
        model.optimizer, compression=cfg.compression, backward_passes_per_step=cfg.backward_passes_per_step
    )
    synced = synchronize_batch_norm(model)
    if synced and rank == 0:
        logger.info("%d BatchNormalization layer(s) use statistics over the global batch (synchronized=True)", synced)

    startup.mark("model")
    data_kw = dict(cfg.data.reader_kwargs(), reader=cfg.reader, storage_options=cfg.store.get("storage_options"))

    user_callbacks = cloudpickle.loads(cfg.callbacks) if cfg.callbacks else []
    state_cb = StateAgreementCallback()
    ticks = _Ticks()
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    store = Store.from_config(cfg.store)
    try:
        with (
            rank_dataset(
                cfg.train_files[rank],
                batch_size=cfg.batch_size,
                shuffle=cfg.shuffle,
                shuffle_buffer_size=cfg.shuffle_buffer_size,
                seed=_rank_seed(cfg.seed, rank),
                first_pass=cfg.initial_epoch,  # a resumed run goes on with new orders, not the first epochs'
                **data_kw,
            ) as train_ds,
            _maybe_val(cfg, rank, data_kw) as val_ds,
        ):
            callbacks: list = [
                startup,
                ticks,
                BroadcastStateCallback(),
                RankRandomnessCallback(cfg.seed, rank),  # after the broadcast, which copies rank 0's generators
                state_cb,  # before validation and checkpoints: layer state agrees
                MetricAverageCallback(),
            ]
            if cfg.val_files is not None:  # every validation row once per evaluation, metrics summed over ranks
                steps = None if cfg.validation_exact else cfg.validation_steps
                callbacks.append(ExactValidationCallback(val_ds, steps, [ticks]))
            callbacks += user_callbacks
            if rank == 0:
                callbacks.append(_CheckpointCallback(store, cfg.run_id, cfg.history_so_far, tmp, cfg.lease, cfg.epochs))
                callbacks.append(_tensorboard(store, cfg.run_id, tmp))
                callbacks.append(EventCallback(cfg.epochs, send_event, cfg.steps_per_epoch, cfg.progress_interval))
            startup.mark("data")
            send_event({"kind": "start", "rank": rank, "initial_epoch": cfg.initial_epoch}) if rank == 0 else None
            t0 = time.time()
            model.fit(
                train_ds,
                epochs=cfg.epochs,
                initial_epoch=cfg.initial_epoch,
                steps_per_epoch=cfg.steps_per_epoch,
                callbacks=callbacks,
                verbose=2 if (cfg.verbose >= 2 and rank == 0) else 0,
                shuffle=False,
            )  # the reader shuffles (row groups, rows, a buffer)
            train_seconds = time.time() - t0
        result = {
            "rank": rank,
            "size": size,
            "weights_digest": _weights_digest(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "train_seconds": train_seconds,
            "host": os.environ.get(settings.ENV_HOST) or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
            "state_reconciled": state_cb.reconciled,
            "startup": startup.phases,
        }
        if rank == 0:
            from hvd_spark._internal.common.serde import save_model_file

            final = os.path.join(tmp, "model.keras")
            save_model_file(model, final)
            store._upload_file(final, cfg.final_model)
            ckpt_cb = next(c for c in callbacks if isinstance(c, _CheckpointCallback))
            result["epoch_logs"] = ckpt_cb.history
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Startup(keras.callbacks.Callback):
    """Where a rank's start went, in seconds per phase: ``process`` (from the task asking for the
    rank's process to ``train``: Python's start and imports for a fresh rank, the wait for its warm
    server and the fork for a warm one; 0 under MPI),
    ``horovod_init``, ``model`` (built or loaded, compiled), ``data`` (readers opened) and
    ``first_epoch`` (its steps, with Keras' tracing of the train step); ``warm`` says how it started."""

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

    def on_epoch_end(self, epoch, logs=None):
        if "first_epoch" not in self.phases:
            self.mark("first_epoch")


class _Ticks(keras.callbacks.Callback):
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
        self._tick(f"epoch {self._epoch} validation step {batch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        self._tick(f"the end of epoch {epoch + 1}")


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _maybe_val(cfg: RunConfig, rank: int, data_kw: dict):
    """This rank's validation rows, read once per evaluation (None: it has none; other ranks do)."""
    from hvd_spark._internal.rank.reader import rank_dataset

    if not cfg.val_files or not cfg.val_files[rank]:
        return _NullContext()
    return rank_dataset(
        cfg.val_files[rank],
        batch_size=cfg.val_batch_size,
        shuffle=False,
        shuffle_buffer_size=1,
        seed=cfg.seed,
        passes=1,
        **data_kw,
    )


def _tensorboard(store, run_id: str, tmp: str):
    class _TB(keras.callbacks.TensorBoard):
        """TensorBoard logs written locally and copied to the run's logs folder after each epoch."""

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)  # written and flushed (TF flushes a writer leaving as_default)
            store._upload_dir(local, store.logs_path(run_id))

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            store._upload_dir(local, store.logs_path(run_id))

    local = os.path.join(tmp, "logs")
    return _TB(log_dir=local, write_graph=False, profile_batch=0, update_freq="epoch")


class _CheckpointCallback(keras.callbacks.Callback):
    """Rank 0: after each epoch, the model (weights, optimizer state, epoch, metrics) to the store.

    The ``.keras`` file is uploaded first and the ``.json`` after it, each atomically; a
    checkpoint counts as complete once its JSON exists. Before writing, the run's writer lease must
    still be this fit's (``lease``: its path and token) and the epoch's checkpoint must not exist:
    a fit that lost its run to another (a stalled or cancelled one) stops with ``RunInUseError``
    instead of writing into it, and a run never holds more epochs than asked.
    """

    def __init__(
        self,
        store,
        run_id: str,
        history_so_far: Sequence[dict],
        tmp: str,
        lease: tuple[str, str] | None = None,
        epochs: int | None = None,
    ):
        super().__init__()
        self.store, self.run_id, self.tmp = store, run_id, tmp
        self.lease, self.epochs = lease, epochs
        self.history: list[dict] = [dict(h) for h in history_so_far]

    def _check_still_ours(self, epoch: int, meta_path: str) -> None:
        from hvd_spark.errors import RunInUseError

        if self.epochs is not None and epoch > self.epochs:
            raise RunInUseError(f"run '{self.run_id}' asked for {self.epochs} epochs; not writing epoch {epoch}.")
        if self.lease is not None:
            path, token = self.lease
            try:
                held = self.store._read_json(path)
            except FileNotFoundError:
                held = None
            if held is None or held.get("token") != token:
                who = f"host {held.get('host')}, pid {held.get('pid')}" if held else "nobody (released)"
                raise RunInUseError(
                    f"run '{self.run_id}' is no longer this fit's to write: its writer lease is held by {who}. "
                    f"The checkpoint of epoch {epoch} was not written.",
                    run_id=self.run_id,
                )
        if self.store._exists(meta_path):
            raise RunInUseError(
                f"the checkpoint of epoch {epoch} of run '{self.run_id}' was written by another fit meanwhile; "
                "not overwriting it.",
                run_id=self.run_id,
            )

    def on_epoch_end(self, epoch, logs=None):
        from hvd_spark._internal.common.events import mark_progress
        from hvd_spark._internal.common.serde import save_model_file
        from hvd_spark._internal.data.store import checkpoint_names

        mark_progress(f"saving the checkpoint of epoch {epoch + 1}")
        logs = {k: float(v) for k, v in (logs or {}).items() if is_number(v)}
        self.history = self.history[:epoch] + [logs]
        model_name, meta_name = checkpoint_names(epoch + 1)
        ckpt_dir = self.store.checkpoints_path(self.run_id)
        self._check_still_ours(epoch + 1, f"{ckpt_dir}/{meta_name}")
        local = os.path.join(self.tmp, model_name)
        save_model_file(self.model, local)
        self.store._upload_file(local, f"{ckpt_dir}/{model_name}")
        self.store._write_json(
            f"{ckpt_dir}/{meta_name}", {"epoch": epoch + 1, "logs": logs, "history": self.history, "time": time.time()}
        )
        os.remove(local)
