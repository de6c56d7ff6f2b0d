"""What each rank runs during ``hvd_spark.lightning.TorchEstimator.fit``: the user's ``LightningModule``
trained by Lightning's ``Trainer`` (DDP over Gloo, its processes created by hvd_spark: Lightning's
``TorchElasticEnvironment`` reads the variables the barrier task set), on the rank's share of the data
plan, with hvd_spark's checkpoints in the store, progress events and results (``_StoreCallback``).

A checkpoint's ``.pt`` holds the module and Lightning's own checkpoint (optimizers, schedulers, loops),
so a resumed fit continues where the run stopped (``Trainer.fit(ckpt_path=...)``).
"""

import logging
import os
import shutil
import socket
import tempfile
import time
from typing import Any

import lightning.pytorch as pl

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy, mark_progress, send_event
from hvd_spark._internal.common.torch_files import FORMAT
from hvd_spark._internal.rank.checkpoints import RunCommits
from hvd_spark._internal.rank.epochs import DataPlan

logger = logging.getLogger(__name__)

SUFFIX = ".pt"


def train(cfg: RunConfig) -> dict:
    """Fits the module with Lightning's ``Trainer``; returns the final weights' digest (and, on rank 0,
    the history)."""
    import cloudpickle
    import torch

    from hvd_spark._internal.data.store import Store
    from hvd_spark._internal.rank.torch_parts import rank_generator_seed

    t0 = time.time()
    store = Store.from_config(cfg.store)
    parts = cloudpickle.loads(cfg.training.compile["torch"])
    rank = int(os.environ.get("RANK", "0"))
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    try:
        module, ckpt_path = _module(cfg, store, tmp)
        pl.seed_everything(rank_generator_seed(cfg.seed, rank), workers=False, verbose=False)
        torch.set_num_threads(max(1, int(cfg.num_threads)))
        data = DataPlan(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        hook = _StoreCallback(cfg, store, tmp, data)
        trainer = _trainer(cfg, parts, tmp, hook)
        loaders = _Loaders(cfg, data, trainer, parts)
        trainer.fit(module, loaders.train(), loaders.val(), ckpt_path=ckpt_path)
        result = {
            "rank": trainer.global_rank,
            "size": trainer.world_size,
            "weights_digest": _digest(module),
            "iterations": int(trainer.global_step),
            "start_iterations": hook.start_iterations,
            "train_seconds": time.time() - t0,
            "host": os.environ.get(settings.ENV_HOST) or socket.gethostname(),
            "startup": {},
        }
        if hook.stopped_for_resize:
            result["stopped_for_resize"] = True
            return result
        if trainer.global_rank == 0:
            hook.save_final(module)
            result["epoch_logs"] = hook.history
            result["stopped"] = None
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _module(cfg: RunConfig, store, tmp: str):
    """The module to train, and Lightning's checkpoint to resume from (None: a new run)."""
    import cloudpickle

    if not cfg.start.resume_ckpt:
        assert cfg.start.model_bytes is not None
        return cloudpickle.loads(cfg.start.model_bytes)["model"], None
    from hvd_spark._internal.common.torch_files import read_torch_file

    saved = read_torch_file(store.files.url(cfg.start.resume_ckpt), store.storage_options)
    path = os.path.join(tmp, "resume.ckpt")
    with open(path, "wb") as f:
        f.write(saved["lightning"])
    return saved["model"], path


def _trainer(cfg: RunConfig, parts: dict, tmp: str, hook):
    """Lightning's ``Trainer`` on this rank: CPU, DDP over Gloo in processes hvd_spark made, no checkpoints
    or progress bar of its own (hvd_spark's), the user's callbacks and logger."""
    from datetime import timedelta

    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    light = parts["lightning"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    timeout = float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS") or 120)
    freq = cfg.training.validation_freq if isinstance(cfg.training.validation_freq, int) else 1
    return pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=max(1, world // local),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=timeout)),
        plugins=[TorchElasticEnvironment()],
        max_epochs=cfg.epochs,
        callbacks=[*light.get("callbacks", []), hook],
        logger=light.get("logger") if light.get("logger") is not None else False,
        log_every_n_steps=int(light.get("log_every_n_steps") or 50),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        check_val_every_n_epoch=freq,
        accumulate_grad_batches=max(1, int(cfg.training.backward_passes_per_step)),
        default_root_dir=tmp,
    )


class _Loaders:
    """The rank's batches for Lightning: ``{column: tensor}`` dicts of its share of each epoch (the epoch
    the trainer is in), and of its validation rows."""

    def __init__(self, cfg: RunConfig, data, trainer, parts: dict):
        self.cfg, self.data, self.trainer, self.parts = cfg, data, trainer, parts
        self.segments = {e: seg for seg in data.segments() for e in range(seg.first, seg.end)}
        self._parquet: Any = None

    def train(self):
        import torch

        loaders = self

        class Epochs(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from loaders._epoch_batches(loaders.trainer.current_epoch)

            def __len__(self):
                seg = loaders.segments.get(loaders.trainer.current_epoch)
                return seg.steps if seg is not None else loaders.cfg.shares.steps_per_epoch

        return torch.utils.data.DataLoader(Epochs(), batch_size=None)

    def val(self):
        import torch

        cfg = self.cfg
        if not (cfg.reading.val_units or (cfg.shares.val_files and any(cfg.shares.val_files))):
            return None
        loaders = self
        _check_validation_rows(cfg, self.trainer.world_size)

        class Validation(torch.utils.data.IterableDataset):
            def __iter__(self):
                from hvd_spark._internal.rank.torch_parts import val_batches

                rank, size = loaders.trainer.global_rank, loaders.trainer.world_size
                for batch in val_batches(cfg, rank, size):
                    yield loaders._named(batch)

        return torch.utils.data.DataLoader(Validation(), batch_size=None)

    def _epoch_batches(self, epoch: int):
        from hvd_spark._internal.rank.rows import ParquetSet, epoch_batches
        from hvd_spark._internal.rank.torch_parts import column_names, user_transformation

        cfg, seg = self.cfg, self.segments.get(epoch)
        if seg is None:
            return
        if self._parquet is None:
            opts = cfg.store.get("storage_options")
            self._parquet = ParquetSet(
                cfg.reading.train_paths, opts, source=cfg.reading.source, workers=cfg.reading.reader_workers[0]
            )
        share = [self.data.epoch_share(seg, self.trainer.global_rank, epoch)]
        fn = user_transformation(cfg)
        for _, batch in epoch_batches(
            self._parquet, self.data.units, share, column_names(cfg.data), cfg.reading.batch_size, True
        ):
            yield self._named(fn(batch) if fn is not None else batch)

    def _named(self, batch: dict) -> dict:
        """Stored columns as ``{the DataFrame's column name: tensor}`` (horovod.spark's batches): features in
        their inputs' shapes and dtypes, labels as stored (int64 integers, float32 otherwise, ``label_shapes``)."""
        import numpy as np
        import torch

        from hvd_spark._internal.rank.torch_parts import shaped

        d, n = self.cfg.data, len(next(iter(batch.values())))
        out = {}
        for c, s in zip(d.features, d.inputs):
            out[c.name] = torch.as_tensor(shaped(batch[c.stored], s.shape, s.dtype or "float32", n))
        for i, c in enumerate(d.labels):
            values = np.asarray(batch[c.stored])
            shape = (d.label_shapes[i] if d.label_shapes else None) or values.shape[1:]
            dtype = "int64" if values.dtype.kind in "iu" else "float32"
            out[c.name] = torch.as_tensor(shaped(values, shape, dtype, n))
        if d.weight is not None:
            out[d.weight.name] = torch.as_tensor(np.asarray(batch[d.weight.stored], dtype=np.float32))
        return out


def _check_validation_rows(cfg: RunConfig, size: int) -> None:
    """Every rank needs validation rows: a rank without any logs no ``val_*`` value, and the ranks' synced
    logging (``sync_dist``) would wait for each other at different collectives."""
    if cfg.reading.val_units:
        total = sum(u[2] for u in cfg.reading.val_units)
        empty = [r for r in range(size) if (r + 1) * total // size - r * total // size == 0]
    else:
        files = list(cfg.shares.val_files or [])
        empty = [r for r in range(size) if r >= len(files) or not files[r]]
    if empty:
        raise ValueError(
            f"validation: ranks {empty} of {size} get no validation rows (a LightningModule's validation needs "
            "rows on every rank). Give the validation more rows (or files) than ranks, or use fewer ranks."
        )


def _digest(module) -> str:
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for v in module.state_dict().values():
        h.update(np.ascontiguousarray(v.detach().cpu().numpy()).tobytes())
    return h.hexdigest()


class _StoreCallback(pl.Callback):
    """hvd_spark's part of the Trainer: rank 0's checkpoints in the store after every epoch (with the
    epoch's logged metrics), the progress events, the stall watchdog's ticks and the resize check."""

    def __init__(self, cfg: RunConfig, store, tmp: str, data):
        self.cfg, self.store, self.tmp, self.data = cfg, store, tmp, data
        self.history = [dict(h) for h in cfg.start.history_so_far]
        self.commits = RunCommits(
            store,
            cfg.run_id,
            tmp,
            cfg.commits.lease,
            cfg.epochs,
            suffix=SUFFIX,
            keep=cfg.commits.keep_checkpoints,
            kept_from=cfg.commits.kept_from,
        )
        self.stopped_for_resize = False
        self.start_iterations = 0
        self._last_position = 0.0

    def on_train_start(self, trainer, module):
        self.start_iterations = int(trainer.global_step)
        if trainer.global_rank == 0:
            send_event({"kind": "start", "rank": 0, "initial_epoch": self.cfg.start.initial_epoch})

    def on_train_end(self, trainer, module):
        from hvd_spark._internal.rank.torch_parts import sync_buffers

        sync_buffers(module)  # BatchNorm's running statistics: rank 0's on every rank (docs/torch.md)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        mark_progress()
        now = time.monotonic()
        if trainer.global_rank == 0 and now - self._last_position >= 0.5:
            self._last_position = now
            send_event({"kind": "position", "iterations": int(trainer.global_step), "time": time.time()})

    def on_train_epoch_end(self, trainer, module):
        epoch = trainer.current_epoch
        logs = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        self.history = self.history[:epoch] + [logs]
        local = os.path.join(self.tmp, "lightning.ckpt")
        with busy(f"saving the checkpoint of epoch {epoch + 1}"):
            trainer.save_checkpoint(local)  # every rank: Lightning's barrier; rank 0 writes
        if trainer.global_rank == 0:
            meta = {"logs": logs, "history": self.history}
            self.commits.write(epoch + 1, 0, meta, lambda path: self._save(module, local, path), trainer.global_step)
            send_event({"kind": "epoch", "epoch": epoch + 1, "epochs": self.cfg.epochs, "logs": logs})
        self._check_resize(trainer, epoch)

    def _save(self, module, lightning_ckpt: str, path: str) -> None:
        import cloudpickle
        import torch

        with open(lightning_ckpt, "rb") as f:
            state = {"format": FORMAT, "model": module, "lightning": f.read()}
        torch.save(state, path, pickle_module=cloudpickle)

    def _check_resize(self, trainer, epoch: int) -> None:
        marker = self.cfg.commits.resize_marker
        if not marker or epoch + 1 >= self.cfg.epochs:
            return
        found = trainer.strategy.broadcast(trainer.global_rank == 0 and self.store.files.exists(marker), src=0)
        if found:
            self.stopped_for_resize = True
            trainer.should_stop = True

    def save_final(self, module) -> None:
        import cloudpickle
        import torch

        from hvd_spark._internal.data.stops import write_end_record

        final = os.path.join(self.tmp, "model.pt")
        with busy("saving the final model"):
            torch.save({"format": FORMAT, "model": module}, final, pickle_module=cloudpickle)
            self.store.files.upload_file(final, self.cfg.commits.final_model)
            write_end_record(self.store, self.cfg.run_id, len(self.history), self.cfg.commits.final_model, final)
