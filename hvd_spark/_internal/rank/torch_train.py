"""What each rank runs during ``TorchEstimator.fit``: a plain torch training loop over the rank's share of
the data plan, its gradients averaged by ``DistributedDataParallel`` over ``torch.distributed``'s Gloo
(ring-allreduce, overlapped with the backward pass), with the Keras ranks' checkpoints, cursor, progress
events and results.

The process group's rendezvous (``MASTER_ADDR`` / ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) comes from
the barrier task (``task/barrier.py``), which got rank 0's address through the driver service. No
TensorFlow, Keras or Horovod here.
"""

import logging
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.events import busy, mark_progress, send_event
from hvd_spark._internal.rank.checkpoints import RunCommits
from hvd_spark._internal.rank.epochs import DataPlan
from hvd_spark._internal.rank.torch_callbacks import Callbacks, TrainState
from hvd_spark._internal.rank.torch_parts import Losses, Metrics, TorchSetup, batch_tensors, load_setup

logger = logging.getLogger(__name__)

SUFFIX = ".pt"


def train(cfg: RunConfig) -> dict:
    """Trains on this rank's share of every epoch; returns the final weights' digest (and, on rank 0,
    the history)."""
    import torch.distributed as dist

    t_entry = time.time()
    rank, size = _init_process_group(cfg)
    tmp = tempfile.mkdtemp(prefix="hvd_spark-rank-")
    try:
        return _Trainer(cfg, rank, size, tmp, t_entry).run()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_process_group(cfg: RunConfig) -> tuple[int, int]:
    """``torch.distributed`` over Gloo from the task's environment (a rank run in this process, as
    the fast tests' backend does: a group of one on a free port)."""
    import torch
    import torch.distributed as dist

    if "MASTER_ADDR" not in os.environ:  # not a barrier task's rank: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    timeout = float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS") or 120)
    mark_progress("torch.distributed.init_process_group")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(max(1, int(cfg.num_threads)))
    from hvd_spark._internal.common.events import report_initialized

    report_initialized()
    return dist.get_rank(), dist.get_world_size()


class _Trainer:
    """One attempt's training on this rank: the segments of epochs of the data plan, a checkpoint after
    each epoch (rank 0), the result."""

    def __init__(self, cfg: RunConfig, rank: int, size: int, tmp: str, t_entry: float):
        from hvd_spark._internal.common import retry
        from hvd_spark._internal.data.store import Store

        self.cfg, self.rank, self.size, self.tmp = cfg, rank, size, tmp
        self.store = Store.from_config(cfg.store)
        retry.set_window(self.store.retry_window)
        self.setup: TorchSetup = load_setup(cfg, self.store, rank)
        self.data = DataPlan(cfg, size)
        self.history = [dict(h) for h in cfg.start.history_so_far]
        self.commits = RunCommits(
            self.store,
            cfg.run_id,
            tmp,
            cfg.commits.lease,
            cfg.epochs,
            suffix=SUFFIX,
            keep=cfg.commits.keep_checkpoints,
            kept_from=cfg.commits.kept_from,
        )
        self.startup = {"process": time.time() - t_entry}
        self.resumed_partial: dict = {}  # rank 0, resuming inside an epoch: its sums before the commit
        if rank == 0 and cfg.start.resume_ckpt and cfg.start.resume_step:
            meta_path = cfg.start.resume_ckpt[: -len(SUFFIX)] + ".json"
            self.resumed_partial = self.store.files.read_json(meta_path).get("partial") or {}
        self.stopped_for_resize = False
        self.callbacks = Callbacks(self.setup.callbacks, TrainState(self.setup.model, self.setup.optimizer, rank, size))
        self.stopped: dict | None = None  # a callback ended the fit: {"epoch", "epochs", "by"}
        self._last_position = 0.0
        self._last_commit = time.monotonic()

    def run(self) -> dict:
        from hvd_spark._internal.data.store import remove_commits_before

        cfg, s = self.cfg, self.setup
        segments = self.data.segments()
        if self.rank == 0 and self.data.restarted_epoch is not None:
            remove_commits_before(self.store, cfg.run_id, self.data.restarted_epoch + 1, 0)
        if self.rank == 0:
            send_event({"kind": "start", "rank": 0, "initial_epoch": cfg.start.initial_epoch})
        t0, start_iterations = time.time(), s.iterations
        self.callbacks.call("on_train_begin")
        for seg in segments:
            for epoch in range(seg.first, seg.end):
                self._epoch(seg, epoch)
                if self.stopped_for_resize or self.stopped:
                    break
            if self.stopped_for_resize or self.stopped:
                break
        s.sync_buffers()  # BatchNorm's running statistics: rank 0's on every rank (docs/torch.md)
        result = {
            "rank": self.rank,
            "size": self.size,
            "weights_digest": s.weights_digest(),
            "iterations": s.iterations,
            "start_iterations": start_iterations,
            "train_seconds": time.time() - t0,
            "host": os.environ.get(settings.ENV_HOST) or socket.gethostname(),
            "startup": self.startup,
        }
        self.callbacks.call("on_train_end")
        if self.stopped_for_resize:
            result["stopped_for_resize"] = True
            return result
        if self.rank == 0:
            self._save_final()
            result["epoch_logs"] = self.history
            result["stopped"] = self.stopped
        return result

    def _epoch(self, seg, epoch: int) -> None:
        """One epoch (or the rest of a resumed one) of ``seg``; its logs and checkpoint."""
        cfg, s = self.cfg, self.setup
        s.train_mode(epoch)
        losses, metrics = Losses(s), Metrics(s.metrics, s.output_names)
        if self.rank == 0 and epoch == seg.first and seg.steps_before:  # the resumed epoch's steps before its commit
            losses.restore(self.resumed_partial.get("losses"))
            metrics.restore(self.resumed_partial.get("metrics"))
        done, before = 0, seg.steps_before if epoch == seg.first else 0
        self.callbacks.call("on_epoch_begin", epoch)
        for _, batch in s.batches(self.data, seg, self.rank, epoch):
            xs, ys, w = batch_tensors(batch, cfg.data, s.class_indices)
            outputs, loss_values = s.step(xs, ys, w, last=done + 1 >= seg.steps)
            losses.add(loss_values, len(w) if w is not None else len(ys[0]))
            metrics.update(outputs, ys)
            done += 1
            mark_progress()
            if self.callbacks:
                self.callbacks.call("on_batch_end", before + done - 1, dict(loss_values))
            self._after_step(seg, epoch, done, losses, metrics)
        logs = {**losses.result(), **metrics.result()}
        if s.validates(epoch):
            logs.update(s.validate(self.rank, self.size))
        self.history = self.history[:epoch] + [logs]
        meta: dict = {"logs": logs, "history": self.history}
        if self.callbacks:
            self._callbacks_epoch_end(epoch, logs, meta)
        if self.rank == 0:
            logger.debug("epoch %d: %s", epoch + 1, logs)
            self.commits.write(epoch + 1, 0, meta, s.save_checkpoint, s.iterations)
            send_event({"kind": "epoch", "epoch": epoch + 1, "epochs": cfg.epochs, "logs": logs})
        if "first_epoch" not in self.startup:
            self.startup["first_epoch"] = time.time() - self.startup["process"]
        if not self.stopped:
            self._check_resize(epoch)

    def _callbacks_epoch_end(self, epoch: int, logs: dict, meta: dict) -> None:
        """The callbacks' ``on_epoch_end``; when one of them on any rank set ``stop_training``, the stop,
        recorded in the epoch's checkpoint (``meta``), so that a restart or a later fit does not train on."""
        import torch
        import torch.distributed as dist

        self.callbacks.call("on_epoch_end", epoch, logs)
        flag = torch.tensor([1 if self.callbacks.state.stop_training else 0], dtype=torch.int32)
        if self.size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]):  # recorded at the last epoch too (as for Keras): a later fit does not train on
            reason = ", ".join(self.callbacks.stopped_by) or f"a callback on another rank than {self.rank}"
            self.stopped = meta["stopped"] = {"epoch": epoch + 1, "epochs": self.cfg.epochs, "by": reason}
            if self.rank == 0:
                logger.info("stopping after epoch %d of %d: %s set stop_training", epoch + 1, self.cfg.epochs, reason)

    def _after_step(self, seg, epoch: int, done: int, losses, metrics) -> None:
        """Rank 0's position and progress events; a commit inside the epoch when one is due."""
        cfg, s = self.cfg, self.setup
        now = time.monotonic()
        if self.rank == 0 and now - self._last_position >= 0.5:
            self._last_position = now
            send_event({"kind": "position", "iterations": s.iterations, "time": time.time()})
            if cfg.progress_interval > 0:
                logs = {"loss": losses.running()}
                event = {"kind": "batch", "epoch": epoch + 1, "epochs": cfg.epochs, "step": done}
                send_event(dict(event, steps=seg.steps, logs=logs))
        every_steps, every_seconds = cfg.commits.checkpoint_steps, cfg.commits.checkpoint_seconds
        if done >= seg.steps or (every_steps is None and every_seconds is None):
            return
        if s.accumulating():
            return  # never between the batches of one update
        in_epoch = (seg.steps_before if epoch == seg.first else 0) + done
        due = every_steps is not None and in_epoch % every_steps == 0  # the same on every rank
        if not due and every_seconds is not None:  # rank 0's clock decides, every rank asks
            due = bool(self._agreed(now - self._last_commit >= every_seconds))
        if not due:
            return
        partial = {"losses": losses.partial(), "metrics": metrics.partial()}  # every rank: summed over all
        if self.rank == 0:
            cursor = self.data.cursor(seg, epoch, done)
            meta = {"logs": {}, "history": self.history[:epoch], "cursor": cursor.to_json(), "partial": partial}
            self.commits.write(epoch, in_epoch, meta, s.save_checkpoint, s.iterations)
        self._last_commit = time.monotonic()

    def _agreed(self, flag: bool) -> int:
        """Rank 0's ``flag``, on every rank."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.broadcast(t, src=0)
        return int(t[0])

    def _check_resize(self, epoch: int) -> None:
        """At an epoch end but the last: rank 0 looks for the driver's resize marker; all ranks stop together."""
        cfg = self.cfg
        if not cfg.commits.resize_marker or epoch + 1 >= cfg.epochs:
            return
        marker = cfg.commits.resize_marker
        if self._agreed(self.rank == 0 and self.store.files.exists(marker)):
            self.stopped_for_resize = True
            if self.rank == 0:
                logger.info("stopping after epoch %d: training resumes on more ranks", epoch + 1)

    def _save_final(self) -> None:
        """Rank 0: the trained model to this fit's file in the store, and the run's end record."""
        from hvd_spark._internal.data.stops import write_end_record

        cfg = self.cfg
        final = os.path.join(self.tmp, "model.pt")
        with busy("saving the final model"):
            self.setup.save_model(final)
            self.store.files.upload_file(final, cfg.commits.final_model)
            write_end_record(self.store, cfg.run_id, len(self.history), cfg.commits.final_model, final)
