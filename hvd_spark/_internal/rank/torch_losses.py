"""Torch losses normalised over the global batch on the ranks (the torch side of ``rank/losses.py``).

``DistributedDataParallel`` averages the ranks' gradients. That is the gradient of one process at the
global batch when each rank's loss is a mean over a batch of as many values as every other rank's
(every rank reads as many rows per step: ``common/dataplan.py``'s shares), but not when:

- the loss is a **sum** (``reduction="sum"``): one process at the global batch sums every rank's values,
  so each rank's loss is multiplied by ``N`` (the world size);
- the loss's **denominator depends on the batch's content**: ``CrossEntropyLoss`` / ``NLLLoss`` (and
  ``F.cross_entropy`` / ``F.nll_loss``, also under ``functools.partial``) with class-index targets divide
  their sum by the number of targets that are not ``ignore_index`` (a padded sequence's masked positions),
  or, with ``weight``, by the sum of those targets' class weights. Each rank's loss is multiplied by
  ``N * local / total``, ``local`` being its denominator and ``total`` the sum of all ranks' (one
  allreduce of a scalar per loss and step, started from the labels before the forward pass and awaited
  before the loss is used).

Then the average of the ranks' gradients is the global batch's gradient and the average of the ranks'
losses its loss. A loss function of the user's own is taken as a mean over its batch's rows, as a loss
module with ``reduction="mean"`` is: a function that masks or sums by itself is normalised per rank.

Validation reports each loss of the whole validation set taken as one batch: the ranks' sums over the
denominators' sum (the sum of the sums for ``reduction="sum"``).
"""

import functools
from typing import Any

_MASKED = ("CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss")


def _unwrapped(fn) -> tuple[Any, dict]:
    """``fn`` without its ``functools.partial`` layers, and their keywords."""
    keywords: dict = {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return fn, keywords


def loss_name(fn) -> str:
    """A loss's name: its function's (a ``functools.partial`` unwrapped), else its class's, or that of
    the class-index loss it subclasses."""
    fn, _ = _unwrapped(fn)
    if hasattr(fn, "reduction"):  # a loss module: a subclass that keeps its base's forward counts as its base
        for c in type(fn).__mro__:
            if c.__name__ in _MASKED and getattr(type(fn), "forward", None) is getattr(c, "forward", None):
                return c.__name__
        return type(fn).__name__
    return getattr(fn, "__name__", None) or type(fn).__name__


def _options(fn) -> dict:
    """The options that set ``fn``'s reduction (a function's defaults are torch's)."""
    fn, keywords = _unwrapped(fn)
    if hasattr(fn, "reduction"):  # a loss module
        opts = {"reduction": fn.reduction, "ignore_index": getattr(fn, "ignore_index", -100)}
        return {**opts, "weight": getattr(fn, "weight", None)}
    return {"reduction": keywords.get("reduction", "mean"), **keywords}


class GlobalLoss:
    """How one loss is normalised over the global batch (see the module's docstring)."""

    def __init__(self, fn, may_ignore: bool = True):
        """``may_ignore``: whether a label may be ``ignore_index`` (the driver knows from the label column's
        statistics); without ignored labels nor class weights, every rank's denominator is its rows."""
        name, opts = loss_name(fn), _options(fn)
        self.reduction = str(opts.get("reduction") or "mean")
        self.ignore_index = int(opts.get("ignore_index", -100))
        self.weight = opts.get("weight")
        self.masked = name in _MASKED and self.reduction == "mean" and (may_ignore or self.weight is not None)

    def denominator(self, y) -> Any:
        """What this loss divides ``y``'s batch sum by where the content decides it, else None."""
        import torch

        if not self.masked or y.is_floating_point():  # class probabilities: a mean over the rows
            return None
        keep = y != self.ignore_index
        if self.weight is None:
            return keep.sum(dtype=torch.float64)
        w = torch.as_tensor(self.weight).to(torch.float64)
        return (w[torch.where(keep, y, torch.zeros_like(y))] * keep).sum()

    def start(self, y, size: int):
        """The allreduce of this rank's denominator, started (``(local, handle)``), or None."""
        import torch.distributed as dist

        local = self.denominator(y) if size > 1 else None
        if local is None:
            return None
        total = local.detach().clone().reshape(1)
        return local, total, dist.all_reduce(total, async_op=True)

    def scale(self, value, pending, size: int, zero=None):
        """``value`` (this rank's loss) normalised over the global batch. A rank whose batch has no counted
        target (all padding: torch's mean is 0/0, NaN, and so is its gradient) contributes ``zero()`` (a
        zero on the outputs' graph, so that DDP's buckets still fill), as it adds nothing to the global
        batch's loss; a global batch with no counted target at all trains nothing (plain torch: NaN)."""
        if size == 1:
            return value
        if self.reduction == "sum":
            return value * size
        if pending is None:
            return value
        local, total, handle = pending
        handle.wait()
        t = float(total[0])
        if not float(local) or not t:
            return zero() if zero is not None else value.nan_to_num() * 0.0
        return value * (size * float(local) / t)


class ValSums:
    """The validation losses of the whole validation set: each loss's sum and denominator over every batch
    of every rank (a loss whose denominator is not the content's: the batch's rows)."""

    def __init__(self, globals_: list[GlobalLoss], weights: list[float], names: list[str]):
        self.g, self.weights, self.names = globals_, weights, names
        self.sums = [0.0] * len(globals_)
        self.dens = [0.0] * len(globals_)
        self.summed = [g.reduction == "sum" for g in globals_]  # a sum of sums (not with sample weights)

    def add(self, values: list, ys: list, rows: int) -> None:
        """One batch: each loss's value and labels (None: a mean over the rows, as with sample weights)."""
        for i, (v, y) in enumerate(zip(values, ys)):
            if y is None:  # sample weights: every loss is a weighted mean over the rows
                self.summed[i] = False
            d = None if y is None else self.g[i].denominator(y)
            d = float(rows) if d is None else float(d)
            if d:  # a batch of padding only: its mean is NaN, its sum nothing
                self.sums[i] += float(v) * (1.0 if self.summed[i] else d)
            self.dens[i] += d

    def result(self, all_sum) -> dict:
        n = len(self.g)
        totals = all_sum(self.sums + self.dens)
        if not any(totals[n:]):
            return {}
        each = [
            totals[i] if summed else (totals[i] / totals[n + i] if totals[n + i] else float("nan"))
            for i, summed in enumerate(self.summed)
        ]
        if n == 1:
            return {"loss": each[0]}
        out = {f"{name}_loss": v for name, v in zip(self.names, each)}
        return {"loss": sum(w * v for w, v in zip(self.weights, each)), **out}


def global_batch_loss(loss_fn, outputs, labels):
    """``loss_fn(outputs, labels)`` normalised over the global batch of ``torch.distributed``'s ranks, as
    ``TorchEstimator`` normalises its losses (see the module's docstring): for a loss computed by the user's
    own code, such as a ``LightningModule``'s ``training_step`` or a function under ``hvd_spark.run``. Every
    rank must call it for every training batch (it allreduces a denominator). Without gradients
    (validation, ``torch.no_grad``) or in a group of one it is ``loss_fn(outputs, labels)`` itself."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size == 1 or not torch.is_grad_enabled():
        return loss_fn(outputs, labels)
    g = GlobalLoss(loss_fn)
    pending = g.start(labels, size)
    return g.scale(loss_fn(outputs, labels), pending, size)
