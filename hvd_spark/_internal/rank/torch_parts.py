"""A torch rank's model, optimizer, losses, metrics and batches (``torch_train.py`` runs the loop).

What the driver sends (``ml/torch_framework.py``): the module and an optimizer built on its parameters,
cloudpickled together (``RunConfig.start.model_bytes``; a checkpoint holds the same pair with the
optimizer's state), and the rest of the training's pieces (``RunConfig.training.compile["torch"]``): an
optimizer factory, the losses and their weights, the metrics, ``train_minibatch_fn``, the learning rate.
"""

import contextlib
import copy
from typing import Any

import numpy as np

from hvd_spark._internal.common.contracts import DataSpec, RunConfig
from hvd_spark._internal.common.torch_files import FORMAT
from hvd_spark._internal.rank.epochs import data_trace, kept_validation_bytes
from hvd_spark._internal.rank.torch_losses import GlobalLoss, ValSums

_STEPS = 0x70C4  # the rank's generator seeds, apart from the data order's


def rank_generator_seed(seed: int, rank: int) -> int:
    """Rank 0 draws from ``random_seed`` itself (as one process seeded with it would); every other rank
    from a seed of its own, so that dropout masks differ between ranks."""
    if rank == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank), _STEPS]).generate_state(1)[0])


def load_setup(cfg: RunConfig, store, rank: int) -> "TorchSetup":
    """The model and optimizer to train: the checkpoint resumed from, else the user's."""
    import cloudpickle
    import torch

    parts = cloudpickle.loads(cfg.training.compile["torch"])
    torch.manual_seed(rank_generator_seed(cfg.seed, rank))
    if cfg.start.resume_ckpt:
        from hvd_spark._internal.common.torch_files import read_torch_file

        saved = read_torch_file(store.files.url(cfg.start.resume_ckpt), store.storage_options)
    else:
        assert cfg.start.model_bytes is not None
        saved = cloudpickle.loads(cfg.start.model_bytes)
    model, optimizer = saved["model"], saved.get("optimizer")
    if optimizer is None:
        optimizer = parts["optimizer_factory"](model.parameters())
    if parts.get("learning_rate") is not None:  # the fit's own, also after a resume
        for group in optimizer.param_groups:
            group["lr"] = float(parts["learning_rate"])
    return TorchSetup(cfg, model, optimizer, parts, int(saved.get("iterations", 0)))


class TorchSetup:
    """The rank's module under ``DistributedDataParallel``, its optimizer, losses and metrics."""

    def __init__(self, cfg: RunConfig, model, optimizer, parts: dict, iterations: int):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.cfg, self.model, self.optimizer, self.iterations = cfg, model, optimizer, iterations
        self.model.train()
        if (dist.is_initialized() and dist.get_world_size() > 1) or parts.get("train_minibatch_fn") is not None:
            unused = bool(parts.get("find_unused_parameters"))
            self.ddp = DistributedDataParallel(model, find_unused_parameters=unused)
        else:  # a group of one trains the module itself (DDP's bucketing and no-op allreduce cost 5-10% a step);
            # a train_minibatch_fn gets DDP's wrapper on any number of ranks (it may use .module, no_sync)
            self.ddp = model
        if cfg.training.compression == "fp16" and self.ddp is not model:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        self.losses = list(parts["losses"])
        may_ignore = parts.get("may_ignore") or [True] * len(self.losses)
        self.global_losses = [GlobalLoss(fn, m) for fn, m in zip(self.losses, may_ignore)]
        self.size = dist.get_world_size() if dist.is_initialized() else 1
        self.loss_weights = list(parts.get("loss_weights") or [1.0] * len(self.losses))
        self.metrics = list(parts.get("metrics") or [])
        self.output_names = list(parts["output_names"])
        self.class_indices = list(parts["class_indices"])
        self._val_budget = kept_validation_bytes(cfg)
        self._val_kept: list | None = None  # the validation batches, once read (_val_batches)
        self.minibatch_fn = parts.get("train_minibatch_fn")
        self.callbacks = list(parts.get("callbacks") or [])  # rank/torch_callbacks.py
        self.k = max(1, int(cfg.training.backward_passes_per_step))
        self._micro = 0
        self._per_sample: dict[int, Any] = {}
        self._parquet: Any = None

    # --- data ---
    def batches(self, data, seg, rank: int, epoch: int):
        """``(epoch, {stored column: rows})`` batches of this rank's share of ``epoch``."""
        from hvd_spark._internal.rank.rows import ParquetSet, epoch_batches

        cfg = self.cfg
        if self._parquet is None:
            workers = cfg.reading.reader_workers[0]
            opts = cfg.store.get("storage_options")
            self._parquet = ParquetSet(
                cfg.reading.train_paths, opts, source=cfg.reading.source, workers=workers, cache=cfg.reading.cache_all
            )
        names = column_names(cfg.data)
        share = [data.epoch_share(seg, rank, epoch)]
        fn = user_transformation(cfg)
        trace = data_trace(rank, seg, data.size)  # HVD_SPARK_DATA_TRACE: what each batch held
        batches = epoch_batches(self._parquet, data.units, share, names, cfg.reading.batch_size, numbered=True)
        for step, (e, batch) in enumerate(batches):
            batch = fn(batch) if fn is not None else batch
            if trace is not None:
                trace(e, step, batch)
            yield e, batch

    def train_mode(self, epoch: int) -> None:
        self.model.train()

    # --- one step ---
    def step(self, xs: list, ys: list, w, last: bool = False):
        """One batch: forward, the loss, backward (gradients averaged over the ranks by DDP), and every
        ``backward_passes_per_step`` batches the optimizer's step; an epoch's ``last`` batch always steps
        (an accumulation never spans two epochs: an epoch's checkpoint holds no pending gradients, so a
        resumed run steps where one fit does, as Lightning's accumulation does). Returns the outputs and
        the losses."""
        if self.minibatch_fn is not None:  # horovod.spark's train_minibatch_fn: the user's own step
            outputs, loss = self.minibatch_fn(
                self.ddp, self.optimizer, _identity_outputs, self.loss_fn, xs, ys[0] if len(ys) == 1 else ys, w
            )
            self.iterations += 1
            outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return outs, {"loss": float(loss.detach())}
        self._micro += 1
        sync = self._micro % self.k == 0 or last
        pending = self._denominators(ys, w)  # started before the forward pass, awaited by the losses
        with contextlib.nullcontext() if sync or self.ddp is self.model else self.ddp.no_sync():
            out = self.ddp(*xs)
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            total, parts, _ = self._losses(outs, ys, w, pending)
            (total / self.k if self.k > 1 else total).backward()
        if sync:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.iterations += 1
            self._micro = 0
        return outs, {"loss": float(total.detach()), **parts}

    def accumulating(self) -> bool:
        """Whether gradients of batches are waiting for their update (``backward_passes_per_step``)."""
        return self.minibatch_fn is None and self._micro % self.k != 0

    def loss_fn(self, outputs, labels, sample_weights=None):
        """horovod.spark's ``loss_fn(outputs, labels, sample_weights)`` for a ``train_minibatch_fn``."""
        outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        ys = list(labels) if isinstance(labels, (list, tuple)) else [labels]
        return self._losses(outs, ys, sample_weights, self._denominators(ys, sample_weights))[0]

    def _denominators(self, ys: list, w) -> list | None:
        """The training losses' global denominators, their allreduce started (``rank/torch_losses.py``);
        None in validation. With sample weights every loss is a mean over the rows: nothing to start."""
        if w is not None:
            return [None] * len(ys)
        return [g.start(y, self.size) for g, y in zip(self.global_losses, ys)]

    def _losses(self, outs: list, ys: list, w, pending: list | None = None) -> tuple[Any, dict, list]:
        """The weighted sum of the outputs' losses, normalised over the global batch in training
        (``pending`` given); with sample weights, each row's loss times its weight, averaged over the batch
        (horovod.spark's rule: the weights are not normalized). Also each output's loss."""
        total: Any = 0.0
        parts, values = {}, []
        for i, (o, y, fn, lw) in enumerate(zip(outs, ys, self.losses, self.loss_weights)):
            if w is None:
                value = fn(o, y)
                if pending is not None:
                    value = self.global_losses[i].scale(value, pending[i], self.size, lambda o=o: o.sum() * 0.0)
            else:
                value = (self._per_sample_loss(i, fn)(o, y).reshape(len(w), -1).mean(1) * w).mean()
            values.append(value)
            total = total + lw * value if len(outs) > 1 else value
            if len(outs) > 1:
                parts[f"{self.output_names[i]}_loss"] = float(value.detach())
        return total, parts, values

    def _per_sample_loss(self, i: int, fn):
        """``fn`` without its reduction: a loss module copied with ``reduction="none"``, a function given it."""
        if i not in self._per_sample:
            if hasattr(fn, "reduction"):
                unreduced = copy.copy(fn)
                unreduced.reduction = "none"
                self._per_sample[i] = unreduced
            else:
                self._per_sample[i] = lambda o, y: fn(o, y, reduction="none")
        return self._per_sample[i]

    # --- validation ---
    def validates(self, epoch: int) -> bool:
        cfg = self.cfg
        if not (cfg.reading.val_units or (cfg.shares.val_files and any(cfg.shares.val_files))):
            return False
        freq = cfg.training.validation_freq
        return (epoch + 1) % freq == 0 if isinstance(freq, int) else (epoch + 1) in freq

    def validate(self, rank: int, size: int) -> dict:
        """Every validation row once, over all ranks: ``val_loss`` (each loss of the whole validation set
        as one batch: ``rank/torch_losses.py``) and ``val_<metric>``."""
        import torch

        losses = ValSums(self.global_losses, self.loss_weights, self.output_names)
        metrics = Metrics(self.metrics, self.output_names)
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in self._val_batches(rank, size):
                    xs, ys, w = batch_tensors(batch, self.cfg.data, self.class_indices)
                    out = self.model(*xs)
                    outs = list(out) if isinstance(out, (list, tuple)) else [out]
                    losses.add(self._losses(outs, ys, w)[2], ys if w is None else [None] * len(ys), len(ys[0]))
                    metrics.update(outs, ys)
        finally:
            self.model.train()
        return {f"val_{k}": v for k, v in {**losses.result(_all_sum), **metrics.result()}.items()}

    def _val_batches(self, rank: int, size: int):
        """This rank's validation batches: read at the first validation and kept in memory (compact copies)
        when they take at most ``kept_validation_bytes``, then every later validation evaluates those; else
        read anew each time."""
        if self._val_kept is not None:
            yield from self._val_kept
            return
        kept: list | None = [] if self._val_budget else None
        nbytes = 0
        for batch in val_batches(self.cfg, rank, size):
            if kept is not None:
                sizes = [_plain_nbytes(v) for v in batch.values()]
                nbytes += sum(n or 0 for n in sizes)
                if None in sizes or nbytes > self._val_budget:
                    kept = None
                else:  # copies: a batch may be a view of a whole row group read for it
                    kept.append({k: np.array(v, copy=True) for k, v in batch.items()})
            yield batch
        self._val_kept = kept  # reached once the batches were read to their end (validate reads them all)

    # --- files ---
    def save_checkpoint(self, local: str) -> None:
        import cloudpickle
        import torch

        state = {"format": FORMAT, "model": self.model, "optimizer": self.optimizer, "iterations": self.iterations}
        torch.save(state, local, pickle_module=cloudpickle)

    def save_model(self, local: str) -> None:
        import cloudpickle
        import torch

        torch.save({"format": FORMAT, "model": self.model}, local, pickle_module=cloudpickle)

    def sync_buffers(self) -> None:
        """Every rank: the module's buffers (BatchNorm's running statistics) made rank 0's. DDP broadcasts
        them before each forward pass, so after the last one every other rank holds its own update."""
        sync_buffers(self.model)

    def weights_digest(self) -> str:
        """A hash of every tensor of the module's ``state_dict``, in its order."""
        import hashlib

        h = hashlib.sha256()
        for v in self.model.state_dict().values():
            h.update(np.ascontiguousarray(v.detach().cpu().numpy()).tobytes())
        return h.hexdigest()


def sync_buffers(module) -> None:
    """``module``'s buffers broadcast from rank 0 (every rank calls it)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        for b in module.buffers():
            dist.broadcast(b.data, src=0)


def _identity_outputs(outputs, labels):
    return outputs, labels


class Losses:
    """The epoch's losses: each batch's, times its rows, summed over the ranks at the end."""

    def __init__(self, setup: TorchSetup):
        self.sums: dict[str, float] = {}
        self.rows = 0

    def add(self, values: dict, rows: int) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * rows
        self.rows += rows

    def running(self) -> float:
        return self.sums.get("loss", 0.0) / max(1, self.rows)

    def partial(self) -> dict:
        """The sums so far over all ranks (every rank calls it): what a commit inside the epoch records."""
        return _global_sums(self.sums, self.rows)

    def restore(self, partial: dict | None) -> None:
        """Rank 0 of a resumed epoch: the sums of the steps before the commit (the other ranks add theirs)."""
        if partial:
            self.sums, self.rows = dict(partial["sums"]), int(partial["rows"])

    def result(self) -> dict:
        names = sorted(self.sums)
        totals = _all_sum([self.sums[k] for k in names] + [float(self.rows)])
        return {k: totals[i] / totals[-1] for i, k in enumerate(names)} if totals[-1] else {}


class Metrics:
    """The user's metrics over an epoch on every rank: a torchmetrics ``Metric`` is updated with each batch
    and computed over all ranks (its states merged through ``torch.distributed``); a function
    ``metric(outputs, labels) -> number`` is averaged over the rows of all ranks."""

    def __init__(self, metrics: list, output_names: list[str]):
        self.metrics, self.names = metrics, output_names
        self.sums: dict[str, float] = {}
        self.rows = 0
        for m in metrics:
            if hasattr(m, "reset") and hasattr(m, "compute"):
                m.reset()

    def _key(self, m, i: int) -> str:
        name = getattr(m, "name", None) or getattr(m, "__name__", None) or type(m).__name__
        return str(name) if len(self.names) == 1 else f"{self.names[i]}_{name}"

    def update(self, outs: list, ys: list) -> None:
        import torch

        with torch.no_grad():
            for i, (o, y) in enumerate(zip(outs, ys)):
                for m in self.metrics:
                    if hasattr(m, "update") and hasattr(m, "compute"):
                        if i == 0:  # a metric object keeps one state: the first output's
                            m.update(o.detach(), y)
                    else:
                        k = self._key(m, i)
                        self.sums[k] = self.sums.get(k, 0.0) + float(m(o.detach(), y)) * len(y)
            self.rows += len(ys[0]) if ys else 0

    def partial(self) -> dict:
        """The functions' sums so far over all ranks (every rank calls it), for a commit inside the epoch.
        A torchmetrics metric's state is not recorded: after a resume it covers the steps after the commit."""
        return _global_sums(self.sums, self.rows)

    def restore(self, partial: dict | None) -> None:
        if partial:
            self.sums, self.rows = dict(partial["sums"]), int(partial["rows"])

    def result(self) -> dict:
        out = {}
        for m in self.metrics:
            if hasattr(m, "update") and hasattr(m, "compute"):
                out[self._key(m, 0)] = float(m.compute())
                m.reset()
        names = sorted(self.sums)
        if names:
            totals = _all_sum([self.sums[k] for k in names] + [float(self.rows)])
            out.update({k: totals[i] / totals[-1] for i, k in enumerate(names)})
        return out


def _global_sums(sums: dict, rows: int) -> dict:
    names = sorted(sums)
    totals = _all_sum([sums[k] for k in names] + [float(rows)])
    return {"sums": dict(zip(names, totals[:-1])), "rows": int(totals[-1])}


def _all_sum(values: list[float]) -> list[float]:
    """``values`` summed over the ranks (in float64)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def column_names(d: DataSpec) -> list[str]:
    return [c.stored for c in (*d.features, *d.labels, *([d.weight] if d.weight else []))]


def user_transformation(cfg: RunConfig):
    if not cfg.reading.transformation_fn:
        return None
    import cloudpickle

    from hvd_spark._internal.rank.rows import transformation

    d = cfg.data
    return transformation(cloudpickle.loads(cfg.reading.transformation_fn), d.features, d.labels, d.weight, d.inputs)


def batch_tensors(batch: dict, d: DataSpec, class_indices: list[bool]):
    """A batch of stored columns as the module's inputs, the losses' labels and the sample weights:
    each feature in its input's shape and dtype; a label in its output's shape (class indices: int64,
    one per row, or in ``label_shapes``' shape); weights float32."""
    import torch

    n = len(next(iter(batch.values())))
    xs = [
        torch.as_tensor(shaped(batch[c.stored], s.shape, s.dtype or "float32", n)) for c, s in zip(d.features, d.inputs)
    ]
    ys = []
    for i, (c, s) in enumerate(zip(d.labels, d.outputs)):
        given = d.label_shapes[i] if d.label_shapes else None
        if class_indices[i]:
            ys.append(torch.as_tensor(shaped(batch[c.stored], given or (), "int64", n)))
        else:
            ys.append(torch.as_tensor(shaped(batch[c.stored], given or s.shape, s.dtype or "float32", n)))
    w = None
    if d.weight is not None:
        w = torch.as_tensor(np.array(batch[d.weight.stored], dtype=np.float32, copy=True))
    return xs, ys, w


def shaped(values, shape, dtype: str, n: int) -> np.ndarray:
    """``values`` in ``shape`` (after the batch axis) and ``dtype``, always a copy of its own: a batch is a
    view of the rows the rank read (of its cache of them, with ``inmemory_cache_all``), so a module that
    edits its input in place (``x.div_(255)``) must edit its own copy, not the rows a later epoch reads."""
    arr = np.asarray(values)
    dims = tuple(int(x) for x in shape if x is not None)
    if len(dims) == len(shape) and int(np.prod(dims, dtype=np.int64)) * n == arr.size:
        arr = arr.reshape((n, *dims))
    return arr.astype(np.dtype(dtype), order="C", copy=True)


def _plain_nbytes(values) -> int | None:
    """The bytes of a batch's column when it is a plain numeric array, else None (not kept)."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return int(values.nbytes)
    return None


def val_batches(cfg: RunConfig, rank: int, size: int):
    """This rank's validation rows, in ``val_batch_size`` batches: its contiguous share of a table's
    validation side read in place, or its own files of the store's copy."""
    from hvd_spark._internal.common.dataplan import Unit, epoch_plan
    from hvd_spark._internal.rank.rows import ParquetSet, batched, column_values, open_parquet

    names = column_names(cfg.data)
    opts = cfg.store.get("storage_options")
    fn = user_transformation(cfg)
    if cfg.reading.val_units:
        units = [Unit(*u) for u in cfg.reading.val_units]
        plan = epoch_plan(units, 0, seed=cfg.seed, shuffle=False, window_rows=0)
        lo, hi = rank * plan.rows // size, (rank + 1) * plan.rows // size
        if hi <= lo:
            return
        from hvd_spark._internal.rank.rows import epoch_batches

        data = ParquetSet(cfg.reading.train_paths, opts, source=cfg.reading.source, side="val")
        share = [(plan, ((lo, hi),), hi - lo)]
        for batch in epoch_batches(data, units, share, names, cfg.reading.val_batch_size):
            yield fn(batch) if fn is not None else batch
        return
    files = cfg.shares.val_files[rank] if cfg.shares.val_files and rank < len(cfg.shares.val_files) else []

    def chunks():
        for path in files:
            table = open_parquet(path, opts).read(columns=names)
            yield {n: column_values(table.column(n)) for n in names}

    for batch in batched(chunks(), cfg.reading.val_batch_size):
        yield fn(batch) if fn is not None else batch
