"""What each rank runs during ``HorovodEstimator.fit``: Keras 3 ``model.fit`` with Horovod.

The fit's backend (``ml/backend.py``; by default one Spark barrier stage) calls :func:`train` on
every rank with one plain-data config; this module never imports pyspark.
"""

import logging
import os
import shutil
import socket
import tempfile
import time
import warnings

import keras

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy
from hvd_spark._internal.rank.carried import CarriedState, capture
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

logger = logging.getLogger(__name__)


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

    startup = Startup(t_entry)
    mark_progress("hvd.init()")
    hvd.init()
    startup.mark("horovod_init")
    set_threads(cfg.num_threads, environment_wins=True)  # backend_env's TF_NUM_*_THREADS win

    from hvd_spark._internal.common import retry
    from hvd_spark._internal.common.events import send_event
    from hvd_spark._internal.common.functions import adopt as adopt_functions
    from hvd_spark._internal.data.store import Store, remove_commits_before
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
        stop_reason,
    )
    from hvd_spark._internal.rank.cursor import DataPlan, PositionCallback, ResizeCheck, Segment
    from hvd_spark._internal.rank.losses import global_batch_losses
    from hvd_spark._internal.rank.optimizer import make_distributed
    from hvd_spark._internal.rank.state import BroadcastStateCallback, StateAgreementCallback

    rank, size = hvd.rank(), hvd.size()
    retry.set_window(Store.from_config(cfg.store).retry_window)  # the driver's, for the reads of the data too
    keras.utils.set_random_seed(cfg.seed)
    custom_objects = cloudpickle.loads(cfg.custom_objects) if cfg.custom_objects else None
    adopt_functions(custom_objects)  # shipped lambdas and closures save under their own names here
    model = build_model(cfg, custom_objects)
    if cfg.compile.get("learning_rate") is not None:
        model.optimizer.learning_rate = float(cfg.compile["learning_rate"])  # the fit's own, also after a resume
    make_distributed(
        model.optimizer,
        compression=cfg.compression,
        backward_passes_per_step=cfg.backward_passes_per_step,
        sparse_as_dense=settings.SPARSE_AS_DENSE.get(),
    )
    global_batch_losses(model)  # masked and weighted-mean losses: one denominator for the global batch
    synced = synchronize_batch_norm(model)
    if synced and rank == 0:
        logger.info("%d BatchNormalization layer(s) use statistics over the global batch (synchronized=True)", synced)

    startup.mark("model")
    data_kw = dict(
        cfg.data.reader_kwargs(),
        reader=cfg.reader,
        storage_options=cfg.store.get("storage_options"),
        prefetch=cfg.prefetch,
        transformation=user_transformation(cfg),
    )

    all_user_callbacks = cloudpickle.loads(cfg.callbacks) if cfg.callbacks else []
    user_callbacks = rank_callbacks(all_user_callbacks, rank)
    step_stops = acts_on_steps(all_user_callbacks)  # the same on every rank: they agree at the same points
    state_cb = StateAgreementCallback()
    ticks = Ticks()
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    store = Store.from_config(cfg.store)
    planned = cfg.reader == "arrow" and bool(cfg.train_units)
    data = DataPlan(cfg, size) if planned else None
    segments = data.segments() if data is not None else [Segment(cfg.initial_epoch, cfg.epochs, cfg.steps_per_epoch)]
    if rank == 0 and data is not None and data.restarted_epoch is not None:
        remove_commits_before(store, cfg.run_id, data.restarted_epoch + 1, 0)  # its new commits take their names
    outputs = os.path.join(tmp, "outputs")  # the working folder during fit: callbacks' relative paths
    os.makedirs(outputs)
    cwd = os.getcwd()
    os.chdir(outputs)
    try:
        with maybe_val(cfg, rank, data_kw) as val_ds:
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
            if cfg.val_files is not None:  # every validation row once per evaluation, metrics summed over ranks
                steps = None if cfg.validation_exact else cfg.validation_steps
                batches = val_batches(cfg, rank, size)
                callbacks.append(
                    ExactValidationCallback(val_ds, steps, [ticks], batches=batches, freq=cfg.validation_freq)
                )
            carried = CarriedState(
                all_user_callbacks, cfg.callback_states, lambda e: checkpoint_weights(cfg, custom_objects, e)
            )
            callbacks += [carried.guard, *user_callbacks, carried]  # their state across attempts and fit calls
            callbacks.append(StopAgreementCallback(step_stops))  # any rank's stop stops all
            if rank == 0:  # after the user's callbacks: what they wrote this epoch
                callbacks.append(OutputsSync(store, outputs, store.outputs_path(cfg.run_id)))
            ckpt_cb = best = None
            if rank == 0:
                ckpt_cb = CheckpointCallback(
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
                    stop_reason=stop_reason(all_user_callbacks),
                    callback_states=lambda: capture(all_user_callbacks),
                    keep=cfg.keep_checkpoints,
                    kept_from=cfg.kept_from,
                )
                callbacks.append(ckpt_cb)
                best = best_checkpoint(cfg, tmp)
                if best is not None:
                    callbacks.append(best)
                callbacks.append(tensorboard(store, cfg.run_id, tmp))
                callbacks.append(EventCallback(cfg.epochs, send_event, cfg.steps_per_epoch, cfg.progress_interval))
                callbacks.append(PositionCallback(send_event))
            resize_cb = None
            if cfg.resize_marker:  # last: the epoch's checkpoint is written before training stops to grow
                marker = cfg.resize_marker
                resize_cb = ResizeCheck(lambda: store.files.exists(marker), cfg.epochs)
                callbacks.append(resize_cb)
            startup.mark("data")
            send_event({"kind": "start", "rank": rank, "initial_epoch": cfg.initial_epoch}) if rank == 0 else None
            t0 = time.time()
            start_iterations = int(model.optimizer.iterations.numpy())
            for seg in segments:
                carried.final = seg is segments[-1]
                if ckpt_cb is not None:
                    ckpt_cb.segment = seg
                with train_data(cfg, rank, data, seg, data_kw) as train_ds, source_errors():
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
            "weights_digest": weights_digest(model),
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
                store.files.upload_file(final, cfg.final_model)
                from hvd_spark._internal.data.stops import write_end_record

                end = ckpt_cb.stopped["epoch"] if ckpt_cb.stopped is not None else len(ckpt_cb.history)
                write_end_record(store, cfg.run_id, end, cfg.final_model, final)  # what later fits of the run return
            result["epoch_logs"] = ckpt_cb.history
            result["stopped"] = ckpt_cb.stopped
        return result
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)
