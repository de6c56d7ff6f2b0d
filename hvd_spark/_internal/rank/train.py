"""What each rank runs during ``HorovodEstimator.fit``: Keras 3 ``model.fit`` with Horovod.

The fit's backend (``ml/backend.py``; by default one Spark barrier stage) calls :func:`train` on
every rank with one plain-data config; this module never imports pyspark. :func:`train` runs the
rank's steps: Horovod's start (:func:`_start`), the model made distributed (:func:`_distributed_model`),
the readers' arguments (:func:`_data_kwargs`), the epochs' segments (:func:`_segments`), the callbacks
in their order (:func:`_callbacks`), the segments trained (:func:`_fit_segments`), the result and, on
rank 0, the final model saved and uploaded (:func:`_save_final`).
"""

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import keras

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy, send_event
from hvd_spark._internal.rank.carried import CarriedState, capture
from hvd_spark._internal.rank.epochs import kept_validation_bytes
from hvd_spark._internal.rank.fit_callbacks import (
    CheckpointCallback,
    FirstStep,
    Startup,
    Ticks,
    best_checkpoint,
    tensorboard,
)
from hvd_spark._internal.rank.inputs import maybe_val, source_errors, train_data, user_transformation, val_batches
from hvd_spark._internal.rank.model import build_model, checkpoint_weights, weights_digest

if TYPE_CHECKING:
    from hvd_spark._internal.data.store import Store
    from hvd_spark._internal.rank.cursor import DataPlan, ResizeCheck, Segment
    from hvd_spark._internal.rank.state import StateAgreementCallback

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Rank:
    """What the steps of one rank's training share."""

    cfg: RunConfig
    rank: int
    size: int
    store: "Store"
    custom_objects: dict | None
    user_callbacks: list  # every callback the user gave (each rank runs its own: ``rank_callbacks``)


@dataclasses.dataclass(frozen=True)
class _Callbacks:
    """The callbacks of the rank's ``model.fit`` calls, in their order, and those the later steps ask."""

    all: list
    state: "StateAgreementCallback"  # whether the layers' state was reconciled
    carried: CarriedState  # told before each segment whether it is the last
    checkpoint: CheckpointCallback | None  # rank 0's: the history, an early stop
    best: Any  # rank 0's checkpoint_callback (a ModelCheckpoint), or None
    resize: "ResizeCheck | None"  # with a resize marker: whether the ranks stopped to grow


def train(cfg: RunConfig) -> dict:
    """Trains on this rank's files; returns the final weights' digest (and, on rank 0, the history)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    startup = _start(cfg, time.time())

    import cloudpickle
    import horovod.tensorflow as hvd

    from hvd_spark._internal.common import retry
    from hvd_spark._internal.data.store import Store

    rank, size = hvd.rank(), hvd.size()
    retry.set_window(Store.from_config(cfg.store).retry_window)  # the driver's, for the reads of the data too
    keras.utils.set_random_seed(cfg.seed)
    custom_objects = cloudpickle.loads(cfg.training.custom_objects) if cfg.training.custom_objects else None
    model = _distributed_model(cfg, rank, custom_objects)
    startup.mark("model")
    data_kw = _data_kwargs(cfg)
    all_user_callbacks = cloudpickle.loads(cfg.training.callbacks) if cfg.training.callbacks else []
    r = _Rank(cfg, rank, size, Store.from_config(cfg.store), custom_objects, all_user_callbacks)
    data, segments = _segments(r)
    with _working_folders() as (tmp, outputs):
        with maybe_val(cfg, rank, data_kw) as val_ds:
            cbs = _callbacks(r, startup, val_ds, data, tmp, outputs)
            startup.mark("data")
            if rank == 0:
                send_event({"kind": "start", "rank": rank, "initial_epoch": cfg.start.initial_epoch})
            start_iterations, train_seconds = _fit_segments(r, model, data, segments, data_kw, cbs)
        result = {
            "rank": rank,
            "size": size,
            "weights_digest": weights_digest(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "start_iterations": start_iterations,
            "train_seconds": train_seconds,
            "host": os.environ.get(settings.ENV_HOST) or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
            "state_reconciled": cbs.state.reconciled,
            "startup": startup.phases,
        }
        if cbs.resize is not None and cbs.resize.stopped:
            result["stopped_for_resize"] = True  # the driver starts the next attempt on more ranks
            return result
        if rank == 0:
            assert cbs.checkpoint is not None
            _save_final(r, model, tmp, cbs.checkpoint, cbs.best)
            result["epoch_logs"] = cbs.checkpoint.history
            result["stopped"] = cbs.checkpoint.stopped
        return result


def _start(cfg: RunConfig, t_entry: float) -> Startup:
    """The rank's start: what the imports made frozen out of full collections, ``hvd.init()``, the
    threads. Returns the start-up phases' record (``t_entry``: when ``train`` was called)."""
    import gc

    import cloudpickle  # noqa: F401 - imported before gc.freeze, which then covers it
    import horovod.tensorflow as hvd

    if os.environ.get(settings.ENV_RANK) is not None:  # a rank's own process (not a caller's, in-process)
        gc.freeze()  # what the imports made lives as long as the process: full collections skip it (warm.py)

    from hvd_spark._internal.common.events import mark_progress
    from hvd_spark._internal.rank.threads import set_threads

    startup = Startup(t_entry)
    mark_progress("hvd.init()")
    hvd.init()
    startup.mark("horovod_init")
    set_threads(cfg.num_threads, environment_wins=True)  # backend_env's TF_NUM_*_THREADS win
    return startup


def _distributed_model(cfg: RunConfig, rank: int, custom_objects: dict | None) -> keras.Model:
    """The user's model, built and compiled on this rank, its optimizer averaging over the ranks, its
    losses normalised over the global batch, its BatchNormalization layers synchronized if asked."""
    from hvd_spark._internal.common.functions import adopt as adopt_functions
    from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm
    from hvd_spark._internal.rank.losses import global_batch_losses
    from hvd_spark._internal.rank.optimizer import make_distributed

    adopt_functions(custom_objects)  # shipped lambdas and closures save under their own names here
    model = build_model(cfg, custom_objects)
    learning_rate = cfg.training.compile.get("learning_rate")
    if learning_rate is not None:
        model.optimizer.learning_rate = float(learning_rate)  # the fit's own, also after a resume
    make_distributed(
        model.optimizer,
        compression=cfg.training.compression,
        backward_passes_per_step=cfg.training.backward_passes_per_step,
        sparse_as_dense=settings.SPARSE_AS_DENSE.get(),
    )
    global_batch_losses(model)  # masked and weighted-mean losses: one denominator for the global batch
    synced = synchronize_batch_norm(model)
    if synced and rank == 0:
        logger.info("%d BatchNormalization layer(s) use statistics over the global batch (synchronized=True)", synced)
    return model


def _data_kwargs(cfg: RunConfig) -> dict:
    """What the readers of the training and validation batches are given."""
    return dict(
        cfg.data.reader_kwargs(),
        reader=cfg.reading.reader,
        storage_options=cfg.store.get("storage_options"),
        prefetch=cfg.reading.prefetch,
        transformation=user_transformation(cfg),
    )


def _segments(r: _Rank) -> "tuple[DataPlan | None, list[Segment]]":
    """The data plan (the arrow reader's shares; None for petastorm) and the runs of epochs ``model.fit``
    is called for. After a restart inside an epoch, rank 0 removes the commits past the one it resumes."""
    from hvd_spark._internal.data.store import remove_commits_before
    from hvd_spark._internal.rank.cursor import DataPlan, Segment

    cfg = r.cfg
    planned = cfg.reading.reader == "arrow" and bool(cfg.reading.train_units)
    data = DataPlan(cfg, r.size) if planned else None
    whole = [Segment(cfg.start.initial_epoch, cfg.epochs, cfg.shares.steps_per_epoch)]
    segments = data.segments() if data is not None else whole
    if r.rank == 0 and data is not None and data.restarted_epoch is not None:
        remove_commits_before(r.store, cfg.run_id, data.restarted_epoch + 1, 0)  # its new commits take their names
    return data, segments


@contextlib.contextmanager
def _working_folders() -> Iterator[tuple[str, str]]:
    """This rank's temporary folder and, inside it, ``outputs``: the working folder during fit (callbacks'
    relative paths). The caller's working folder is back and the temporary folder gone at the end."""
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    try:
        outputs = os.path.join(tmp, "outputs")
        os.makedirs(outputs)
        cwd = os.getcwd()
        os.chdir(outputs)
        try:
            yield tmp, outputs
        finally:
            os.chdir(cwd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _callbacks(r: _Rank, startup: Startup, val_ds, data: "DataPlan | None", tmp: str, outputs: str) -> _Callbacks:
    """The callbacks of every ``model.fit`` call, in the order they must run (the comments say why)."""
    from hvd_spark._internal.rank.callbacks import (
        ExactValidationCallback,
        MetricAverageCallback,
        RankRandomnessCallback,
        StopAgreementCallback,
        UpdateCheckCallback,
        acts_at_epoch_ends,
        acts_at_epoch_starts,
        acts_on_steps,
        rank_callbacks,
    )
    from hvd_spark._internal.rank.cursor import ResizeCheck
    from hvd_spark._internal.rank.state import BroadcastStateCallback, StateAgreementCallback

    cfg, rank = r.cfg, r.rank
    user_callbacks = rank_callbacks(r.user_callbacks, rank)
    step_stops = acts_on_steps(r.user_callbacks)  # the same on every rank: they agree at the same points
    state_cb = StateAgreementCallback()
    ticks = Ticks()
    callbacks: list = [
        startup,
        ticks,
        FirstStep(),
        BroadcastStateCallback(),
        RankRandomnessCallback(cfg.seed, rank),  # after the broadcast, which copies rank 0's generators
        UpdateCheckCallback(),  # weights equal on all ranks after the first step: updates were averaged
        state_cb,  # before validation and checkpoints: layer state agrees
        MetricAverageCallback(),
    ]
    if cfg.shares.val_files is not None:  # every validation row once per evaluation, metrics summed over ranks
        steps = None if cfg.reading.validation_exact else cfg.shares.validation_steps
        batches = val_batches(cfg, rank, r.size)
        keep = kept_validation_bytes(cfg)
        freq = cfg.training.validation_freq
        rows = cfg.reading.val_batch_size
        callbacks.append(
            ExactValidationCallback(
                val_ds, steps, [ticks], batches=batches, freq=freq, keep_bytes=keep, batch_size=rows
            )
        )
    carried = CarriedState(
        r.user_callbacks, cfg.start.callback_states, lambda e: checkpoint_weights(cfg, r.custom_objects, e)
    )
    callbacks += [carried.guard, *user_callbacks, carried]  # their state across attempts and fit calls
    starts, ends = acts_at_epoch_starts(r.user_callbacks), acts_at_epoch_ends(r.user_callbacks)
    callbacks.append(StopAgreementCallback(step_stops, starts, ends))  # any rank's stop stops all
    ckpt_cb = best = None
    if rank == 0:  # after the user's callbacks: what they wrote this epoch
        firsts, ckpt_cb, best = _rank0_callbacks(r, data, tmp, outputs)
        callbacks += firsts
    resize_cb = None
    if cfg.commits.resize_marker:  # last: the epoch's checkpoint is written before training stops to grow
        marker = cfg.commits.resize_marker
        resize_cb = ResizeCheck(lambda: r.store.files.exists(marker), cfg.epochs)
        callbacks.append(resize_cb)
    return _Callbacks(callbacks, state_cb, carried, ckpt_cb, best, resize_cb)


def _rank0_callbacks(r: _Rank, data: "DataPlan | None", tmp: str, outputs: str) -> tuple[list, CheckpointCallback, Any]:
    """Rank 0's callbacks, in their order: the outputs' copy, the run's checkpoints, checkpoint_callback,
    TensorBoard, progress events. Returns them with the checkpoints' callback and checkpoint_callback's."""
    from hvd_spark._internal.rank.callbacks import EventCallback, OutputsSync, stop_reason
    from hvd_spark._internal.rank.cursor import PositionCallback

    cfg, store = r.cfg, r.store
    callbacks: list = [OutputsSync(store, outputs, store.outputs_path(cfg.run_id))]
    ckpt_cb = CheckpointCallback(
        store,
        cfg.run_id,
        cfg.start.history_so_far,
        tmp,
        cfg.commits.lease,
        cfg.epochs,
        data=data,
        every_steps=cfg.commits.checkpoint_steps,
        every_seconds=cfg.commits.checkpoint_seconds,
        step_multiple=cfg.training.backward_passes_per_step,
        stop_reason=stop_reason(r.user_callbacks),
        callback_states=lambda: capture(r.user_callbacks),
        keep=cfg.commits.keep_checkpoints,
        kept_from=cfg.commits.kept_from,
    )
    callbacks.append(ckpt_cb)
    best = best_checkpoint(cfg, tmp)
    if best is not None:
        callbacks.append(best)
    callbacks.append(tensorboard(store, cfg.run_id, tmp))
    callbacks.append(EventCallback(cfg.epochs, send_event, cfg.shares.steps_per_epoch, cfg.progress_interval))
    callbacks.append(PositionCallback(send_event))
    return callbacks, ckpt_cb, best


def _fit_segments(
    r: _Rank, model, data: "DataPlan | None", segments: "list[Segment]", data_kw: dict, cbs: _Callbacks
) -> tuple[int, float]:
    """One ``model.fit`` per segment, until the last, an early stop or a stop to grow. Returns the
    optimizer's step count before the first and the seconds they took."""
    cfg, rank = r.cfg, r.rank
    t0 = time.time()
    start_iterations = int(model.optimizer.iterations.numpy())
    for seg in segments:
        cbs.carried.final = seg is segments[-1]
        if cbs.checkpoint is not None:
            cbs.checkpoint.segment = seg
        with train_data(cfg, rank, data, seg, data_kw) as train_ds, source_errors():
            model.fit(
                train_ds,
                epochs=seg.end,
                initial_epoch=seg.first,
                steps_per_epoch=seg.steps,
                callbacks=cbs.all,
                verbose=2 if (cfg.verbose >= 2 and rank == 0) else 0,
                shuffle=False,
                class_weight=cfg.training.class_weight,
            )  # the reader shuffles (row-group order, rows within windows)
        if (cbs.resize is not None and cbs.resize.stopped) or model.stop_training:
            break
    return start_iterations, time.time() - t0


def _save_final(r: _Rank, model, tmp: str, ckpt_cb: CheckpointCallback, best) -> None:
    """Rank 0: the model ``fit`` returns (checkpoint_callback's choice if it made one) uploaded to
    ``cfg.commits.final_model``, and the run's end record naming it."""
    from hvd_spark._internal.common.serde import save_model_file
    from hvd_spark._internal.data.stops import write_end_record

    cfg, store = r.cfg, r.store
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
        store.files.upload_file(final, cfg.commits.final_model)
        end = ckpt_cb.stopped["epoch"] if ckpt_cb.stopped is not None else len(ckpt_cb.history)
        write_end_record(store, cfg.run_id, end, cfg.commits.final_model, final)  # what later fits of the run return
