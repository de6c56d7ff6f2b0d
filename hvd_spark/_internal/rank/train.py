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
from typing import Any

import keras

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy
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
    """The model to train: the latest checkpoint when resuming, else the user's model, compiled as the
    user compiled it (every ``compile`` option: ``weighted_metrics``, ``steps_per_execution``,
    ``jit_compile``, ``run_eagerly``, ``auto_scale_loss``, the dtype policy) with the optimizer, loss,
    metrics and loss weights given as Params in place of the model's."""
    from hvd_spark._internal.common.serde import load_model_file, loads_keras_obj, model_from_bytes
    from hvd_spark._internal.data.store import Store

    comp = cfg.compile
    policy = comp.get("dtype_policy")
    if policy and (policy != "mixed_float16" or comp.get("auto_scale_loss", True)):
        # A Functional model takes the global policy as its own when it is loaded: under the driver's
        # "mixed_float16", compile wraps the optimizer in a LossScaleOptimizer, as it did there.
        keras.mixed_precision.set_global_policy(policy)
    if cfg.resume_ckpt:
        store = Store.from_config(cfg.store)
        # Weights, optimizer state (its step counter included) and compile config, as saved.
        resume_ckpt = cfg.resume_ckpt
        model = store._retrying(
            f"loading the checkpoint {store._rel(resume_ckpt)}",
            lambda: load_model_file(
                store._url(resume_ckpt), custom_objects, compile=True, storage_options=store.storage_options
            ),
        )
    elif cfg.model_bytes is None:
        raise ValueError("The run configuration has neither a checkpoint to resume nor the model to start from.")
    else:
        model = model_from_bytes(cfg.model_bytes, custom_objects=custom_objects, compile=True)
        given = {k: comp.get(k) for k in ("optimizer", "loss", "metrics", "loss_weights") if comp.get(k) is not None}
        if given or not getattr(model, "compiled", False):
            kwargs = _compile_config(model, custom_objects)
            kwargs.update({k: loads_keras_obj(v, custom_objects) for k, v in given.items() if k != "loss_weights"})
            if "loss_weights" in given:
                kwargs["loss_weights"] = given["loss_weights"]
            if isinstance(kwargs.get("optimizer"), str):
                kwargs["optimizer"] = keras.optimizers.get(kwargs["optimizer"])
            model.compile(**kwargs, auto_scale_loss=comp.get("auto_scale_loss", True))
    _no_jit_across_ranks(model)
    return model


def _compile_config(model, custom_objects) -> dict:
    """``compile``'s arguments as the model was compiled (all of them but ``auto_scale_loss``, which
    Keras does not keep), with the loaded optimizer itself (its state) in place of its config."""
    if not getattr(model, "compiled", False):
        return {}
    config = model.get_compile_config() or {}
    with keras.saving.custom_object_scope(custom_objects or {}):
        kwargs = dict(keras.saving.deserialize_keras_object(config)) if config else {}
    if getattr(model, "optimizer", None) is not None:
        kwargs["optimizer"] = model.optimizer
    return kwargs


def _no_jit_across_ranks(model) -> None:
    """XLA cannot compile Horovod's collectives into the train step: with several ranks the step runs
    as a plain ``tf.function`` (a user's ``jit_compile=True`` is turned off, with a warning)."""
    import horovod.tensorflow as hvd

    if hvd.size() > 1 and getattr(model, "jit_compile", False):
        if hvd.rank() == 0:
            logger.warning(
                "jit_compile=True is turned off on the ranks: XLA cannot compile Horovod's gradient allreduce "
                "into the train step (the step runs as a tf.function without XLA). Layers can still use XLA "
                "themselves."
            )
        model.jit_compile = False


def train(cfg: RunConfig) -> dict:
    """Trains on this rank's files; returns the final weights' digest (and, on rank 0, the history)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    t_entry = time.time()
    import gc

    import cloudpickle
    import horovod.tensorflow as hvd

    if os.environ.get(settings.ENV_RANK) is not None:  # a rank's own process (not a caller's, in-process)
        gc.freeze()  # what the imports made lives as long as the process: full collections skip it (warm.py)

    from hvd_spark._internal.common.events import mark_progress
    from hvd_spark._internal.rank.threads import set_threads

    startup = _Startup(t_entry)
    mark_progress("hvd.init()")
    hvd.init()
    startup.mark("horovod_init")
    set_threads(cfg.num_threads, environment_wins=True)  # backend_env's TF_NUM_*_THREADS win

    from hvd_spark._internal.common import retry
    from hvd_spark._internal.common.events import send_event
    from hvd_spark._internal.data.store import Store
    from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm
    from hvd_spark._internal.rank.callbacks import (
        EventCallback,
        ExactValidationCallback,
        MetricAverageCallback,
        OutputsSync,
        RankRandomnessCallback,
        StopAgreementCallback,
        UpdateCheckCallback,
        acts_on_steps,
        rank_callbacks,
    )
    from hvd_spark._internal.rank.cursor import DataPlan, PositionCallback, ResizeCheck, Segment
    from hvd_spark._internal.rank.optimizer import make_distributed
    from hvd_spark._internal.rank.state import BroadcastStateCallback, StateAgreementCallback

    rank, size = hvd.rank(), hvd.size()
    retry.set_window(Store.from_config(cfg.store).retry_window)  # the driver's, for the reads of the data too
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
    data_kw = dict(
        cfg.data.reader_kwargs(),
        reader=cfg.reader,
        storage_options=cfg.store.get("storage_options"),
        prefetch=cfg.prefetch,
        transformation=_transformation(cfg),
    )

    all_user_callbacks = cloudpickle.loads(cfg.callbacks) if cfg.callbacks else []
    user_callbacks = rank_callbacks(all_user_callbacks, rank)
    step_stops = acts_on_steps(all_user_callbacks)  # the same on every rank: they agree at the same points
    state_cb = StateAgreementCallback()
    ticks = _Ticks()
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    store = Store.from_config(cfg.store)
    planned = cfg.reader == "arrow" and bool(cfg.train_units)
    data = DataPlan(cfg, size) if planned else None
    segments = data.segments() if data is not None else [Segment(cfg.initial_epoch, cfg.epochs, cfg.steps_per_epoch)]
    if rank == 0 and data is not None and data.restarted_epoch is not None:
        store._remove_commits_before(cfg.run_id, data.restarted_epoch + 1, 0)  # its new commits take their names
    outputs = os.path.join(tmp, "outputs")  # the working folder during fit: callbacks' relative paths
    os.makedirs(outputs)
    cwd = os.getcwd()
    os.chdir(outputs)
    try:
        with _maybe_val(cfg, rank, data_kw) as val_ds:
            callbacks: list = [
                startup,
                ticks,
                _FirstStep(),
                BroadcastStateCallback(),
                RankRandomnessCallback(cfg.seed, rank),  # after the broadcast, which copies rank 0's generators
                UpdateCheckCallback(),  # weights equal on all ranks after the first step: updates were averaged
                state_cb,  # before validation and checkpoints: layer state agrees
                MetricAverageCallback(),
            ]
            if cfg.val_files is not None:  # every validation row once per evaluation, metrics summed over ranks
                steps = None if cfg.validation_exact else cfg.validation_steps
                batches = _val_batches(cfg, rank, size)
                callbacks.append(
                    ExactValidationCallback(val_ds, steps, [ticks], batches=batches, freq=cfg.validation_freq)
                )
            callbacks += user_callbacks
            callbacks.append(StopAgreementCallback(step_stops))  # any rank's stop stops all
            if rank == 0:  # after the user's callbacks: what they wrote this epoch
                callbacks.append(OutputsSync(store, outputs, store.outputs_path(cfg.run_id)))
            ckpt_cb = best = None
            if rank == 0:
                ckpt_cb = _CheckpointCallback(
                    store,
                    cfg.run_id,
                    cfg.history_so_far,
                    tmp,
                    cfg.lease,
                    cfg.epochs,
                    data=data,
                    every_steps=cfg.checkpoint_steps,
                    every_seconds=cfg.checkpoint_seconds,
                    step_multiple=cfg.backward_passes_per_step,
                )
                callbacks.append(ckpt_cb)
                best = _best_checkpoint(cfg, tmp)
                if best is not None:
                    callbacks.append(best)
                callbacks.append(_tensorboard(store, cfg.run_id, tmp))
                callbacks.append(EventCallback(cfg.epochs, send_event, cfg.steps_per_epoch, cfg.progress_interval))
                callbacks.append(PositionCallback(send_event))
            resize_cb = None
            if cfg.resize_marker:  # last: the epoch's checkpoint is written before training stops to grow
                marker = cfg.resize_marker
                resize_cb = ResizeCheck(lambda: store._exists(marker), cfg.epochs)
                callbacks.append(resize_cb)
            startup.mark("data")
            send_event({"kind": "start", "rank": rank, "initial_epoch": cfg.initial_epoch}) if rank == 0 else None
            t0 = time.time()
            start_iterations = int(model.optimizer.iterations.numpy())
            for seg in segments:
                if ckpt_cb is not None:
                    ckpt_cb.segment = seg
                with _train_data(cfg, rank, data, seg, data_kw) as train_ds, _source_errors():
                    model.fit(
                        train_ds,
                        epochs=seg.end,
                        initial_epoch=seg.first,
                        steps_per_epoch=seg.steps,
                        callbacks=callbacks,
                        verbose=2 if (cfg.verbose >= 2 and rank == 0) else 0,
                        shuffle=False,
                        class_weight=cfg.class_weight,
                    )  # the reader shuffles (row-group order, rows within windows)
                if (resize_cb is not None and resize_cb.stopped) or model.stop_training:
                    break
            train_seconds = time.time() - t0
        result = {
            "rank": rank,
            "size": size,
            "weights_digest": _weights_digest(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "start_iterations": start_iterations,
            "train_seconds": train_seconds,
            "host": os.environ.get(settings.ENV_HOST) or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
            "state_reconciled": state_cb.reconciled,
            "startup": startup.phases,
        }
        if resize_cb is not None and resize_cb.stopped:
            result["stopped_for_resize"] = True  # the driver starts the next attempt on more ranks
            return result
        if rank == 0:
            from hvd_spark._internal.common.serde import save_model_file

            assert ckpt_cb is not None
            final = os.path.join(tmp, "model.keras")
            best_file = getattr(best, "filepath", None) if best is not None else None
            with busy("saving the final model"):
                if best is not None and best_file and os.path.exists(best_file):  # checkpoint_callback's choice
                    if best.save_weights_only:
                        model.load_weights(best_file)
                    else:
                        final = best_file
                        logger.info("the model returned is checkpoint_callback's (%s)", best.monitor)
                if final != best_file:
                    save_model_file(model, final)
                store._upload_file(final, cfg.final_model)
            result["epoch_logs"] = ckpt_cb.history
        return result
    finally:
        os.chdir(cwd)
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
        from hvd_spark._internal.common.events import keep_alive

        keep_alive(f"epoch {self._epoch} validation step {batch + 1}")  # alive; not a step ahead of a peer

    def on_epoch_end(self, epoch, logs=None):
        self._tick(f"the end of epoch {epoch + 1}")


class _FirstStep(keras.callbacks.Callback):
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


class _source_errors:
    """Within the block, an error of the reader's Python code that reached Keras wrapped in a
    ``tf.errors.UnknownError`` is raised as itself (a ``StoreUnavailableError`` stays one)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            from hvd_spark._internal.rank.pysource import reraise_source_error

            reraise_source_error(exc)
        return False


def _train_data(cfg: RunConfig, rank: int, data, seg, data_kw: dict):
    """The rank's training batches for the epochs of ``seg``: its shares of the data plan (the arrow
    reader), or its own files read endlessly (petastorm; whole epochs only)."""
    import contextlib

    from hvd_spark._internal.rank.reader import planned_dataset, rank_dataset

    if data is None:
        return rank_dataset(
            cfg.train_files[rank],
            batch_size=cfg.batch_size,
            shuffle=cfg.shuffle,
            shuffle_buffer_size=cfg.shuffle_buffer_size,
            seed=_rank_seed(cfg.seed, rank),
            first_pass=seg.first,
            **data_kw,
        )
    kw = {k: v for k, v in data_kw.items() if k not in ("reader",)}
    trace = _data_trace(rank, seg, data.size)
    ds = planned_dataset(
        cfg.train_paths,
        data.units,
        data.epochs_of(seg, rank),
        batch_size=cfg.batch_size,
        trace=trace,
        source=cfg.source,
        workers=cfg.reader_workers[0],
        cache=cfg.cache_all,
        **kw,
    )
    return contextlib.nullcontext(ds)


def _best_checkpoint(cfg: RunConfig, tmp: str):
    """horovod.spark's ``checkpoint_callback`` (a ModelCheckpoint), writing to this rank's temporary
    folder; its last file becomes the model fit returns. None when not given."""
    if not cfg.checkpoint_callback:
        return None
    import cloudpickle

    cb = cloudpickle.loads(cfg.checkpoint_callback)
    cb.filepath = os.path.join(tmp, "best.weights.h5" if cb.save_weights_only else "best.keras")
    return cb


def _transformation(cfg: RunConfig):
    """horovod.spark's ``transformation_fn`` as a function of a block of rows, or None."""
    if not cfg.transformation_fn:
        return None
    import cloudpickle

    from hvd_spark._internal.rank.rows import transformation

    d = cfg.data
    return transformation(cloudpickle.loads(cfg.transformation_fn), d.features, d.labels, d.weight)


def _data_trace(rank: int, seg, size: int):
    """``HVD_SPARK_DATA_TRACE``: a JSON line per batch read (epoch, step within the epoch, the first
    feature column's values), appended to this process's file in that folder; None when unset."""
    folder = settings.DATA_TRACE.get()
    if not folder:
        return None
    import json

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.jsonl")

    def trace(epoch: int, step: int, batch: dict) -> None:
        first = next(iter(batch.values()))
        ids = first[:, 0] if first.ndim > 1 else first
        step += seg.steps_before if epoch == seg.first else 0
        record = {"t": time.time(), "rank": rank, "size": size, "epoch": epoch, "step": step, "ids": ids.tolist()}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    return trace


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _maybe_val(cfg: RunConfig, rank: int, data_kw: dict):
    """This rank's validation rows, read once per evaluation (None: it has none; other ranks do)."""
    from hvd_spark._internal.rank.reader import rank_dataset

    if cfg.val_units:
        return _planned_val(cfg, rank, data_kw)
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


def _val_batches(cfg: RunConfig, rank: int, size: int) -> int | None:
    """The batches of this rank's validation rows (``_maybe_val``), from the row counts the driver
    planned with; None when a ``transformation_fn`` may change the rows (they are counted instead)."""
    import math

    if cfg.transformation_fn:
        return None
    if cfg.val_units:
        total = sum(u[2] for u in cfg.val_units)
        rows = (rank + 1) * total // size - rank * total // size
    else:
        counts = dict(cfg.val_table)
        mine = cfg.val_files[rank] if cfg.val_files and rank < len(cfg.val_files) else []
        if any(path not in counts for path in mine):
            return None
        rows = sum(counts[path] for path in mine)
    return math.ceil(rows / cfg.val_batch_size)


def _planned_val(cfg: RunConfig, rank: int, data_kw: dict):
    """The validation rows of a table read in place: the rows of every row group's validation side in
    stored order, cut into one contiguous share per rank (all of them: each row is evaluated once)."""
    import contextlib

    import horovod.tensorflow as hvd

    from hvd_spark._internal.common.dataplan import Unit, epoch_plan
    from hvd_spark._internal.rank.reader import planned_dataset

    size = hvd.size()
    units = [Unit(*u) for u in cfg.val_units]
    plan = epoch_plan(units, 0, seed=cfg.seed, shuffle=False, window_rows=0)
    lo, hi = rank * plan.rows // size, (rank + 1) * plan.rows // size
    if hi <= lo:
        return _NullContext()
    kw = {k: v for k, v in data_kw.items() if k not in ("reader",)}
    ds = planned_dataset(
        cfg.train_paths,
        units,
        lambda: iter([(plan, ((lo, hi),), hi - lo)]),
        batch_size=cfg.val_batch_size,
        source=cfg.source,
        side="val",
        workers=cfg.reader_workers[1],
        cache=cfg.cache_all,
        **kw,
    )
    return contextlib.nullcontext(ds)


def _tensorboard(store, run_id: str, tmp: str):
    class _TB(keras.callbacks.TensorBoard):
        """TensorBoard logs written locally and copied to the run's logs folder after each epoch."""

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)  # written and flushed (TF flushes a writer leaving as_default)
            with busy("uploading TensorBoard logs"):
                store._upload_dir(local, store.logs_path(run_id))

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            store._upload_dir(local, store.logs_path(run_id))

        def on_train_batch_begin(self, batch, logs=None):
            self._global_train_batch += 1  # Keras' count; no profiling (profile_batch=0)

        def on_train_batch_end(self, batch, logs=None):
            """Nothing: the logs are written per epoch. Keras 3's TensorBoard calls ``tf.summary.scalar``
            for every log after every batch whatever its ``update_freq`` (writing nothing with no
            default writer), about 10% of a rank's time at 128 rows per step."""

    local = os.path.join(tmp, "logs")
    return _TB(log_dir=local, write_graph=False, profile_batch=0, update_freq="epoch")


class _CheckpointCallback(keras.callbacks.Callback):
    """Rank 0: after each epoch, the model (weights, optimizer state, epoch, metrics) to the store;
    with ``every_steps`` or ``every_seconds``, also commits inside an epoch, each recording the data
    cursor (``data.cursor``: which positions every rank has read) and the optimizer's step count.

    The ``.keras`` file is uploaded first and the ``.json`` after it, each atomically; a
    checkpoint counts as complete once its JSON exists, so a crash while committing leaves the
    previous one the latest. A complete checkpoint removes the commits before it. Before writing,
    the run's writer lease must still be this fit's (``lease``: its path and token) and the
    checkpoint must not exist: a fit that lost its run to another (a stalled or cancelled one) stops
    with ``RunInUseError`` instead of writing into it, and a run never holds more epochs than asked.
    Commits fall on multiples of ``step_multiple`` steps (``backward_passes_per_step``: never between
    the batches of one update).
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
    ):
        super().__init__()
        self.store, self.run_id, self.tmp = store, run_id, tmp
        self.lease, self.epochs = lease, epochs
        self.history: list[dict] = [dict(h) for h in history_so_far]
        self.data, self.every_steps, self.every_seconds = data, every_steps, every_seconds
        self.step_multiple = max(1, step_multiple)
        self.segment: Any = None  # the rank/cursor.Segment being trained: set by train() before each model.fit
        self._epoch = 0
        self._last_commit = time.monotonic()

    def _check_still_ours(self, epoch: int, meta_path: str, what: str) -> None:
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
                    f"The checkpoint of {what} was not written.",
                    run_id=self.run_id,
                )
        if self.store._exists(meta_path):
            raise RunInUseError(
                f"the checkpoint of {what} of run '{self.run_id}' was written by another fit meanwhile; "
                "not overwriting it.",
                run_id=self.run_id,
            )

    def _write(self, epoch: int, step: int, meta: dict) -> None:
        """The checkpoint after ``epoch`` epochs and ``step`` steps of the next one."""
        from hvd_spark._internal.common.serde import save_model_file
        from hvd_spark._internal.data.store import checkpoint_names, file_digest

        what = f"epoch {epoch} step {step}" if step else f"epoch {epoch}"
        with busy(f"saving the checkpoint of {what}"):  # a large model to an object store: slow, not stalled
            model_name, meta_name = checkpoint_names(epoch, step)
            ckpt_dir = self.store.checkpoints_path(self.run_id)
            self._check_still_ours(epoch if step == 0 else epoch + 1, f"{ckpt_dir}/{meta_name}", what)
            local = os.path.join(self.tmp, model_name)
            save_model_file(self.model, local)
            written = file_digest(local)  # the JSON records them: a damaged upload is never resumed from
            self.store._upload_file(local, f"{ckpt_dir}/{model_name}")
            meta = dict(
                meta, epoch=epoch, step=step, iterations=int(self.model.optimizer.iterations.numpy()), **written
            )
            self.store._write_json(f"{ckpt_dir}/{meta_name}", dict(meta, time=time.time()))
            os.remove(local)
            self.store._remove_commits_before(self.run_id, epoch, step)
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
        self._write(epoch + 1, 0, {"logs": logs, "history": self.history})
