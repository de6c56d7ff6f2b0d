"""How a run ended, as part of its state. When EarlyStopping, TerminateOnNaN or a user's
``model.stop_training`` ends training, rank 0 records the stop with that epoch's checkpoint (its JSON's
``stopped``). Once a fit that trained to its end (its epochs, or the stop) uploaded its model, rank 0
writes an end record naming it (``checkpoints/epoch-NNNN-end.json``): the model as the callbacks left it
at the end of training (EarlyStopping's restored best weights, ``checkpoint_callback``'s best), which
differs from the epoch's checkpoint. A restart, a resize or a later fit that finds the stop trains no
further, and a later fit of the finished run returns that model (``ml/controller.py``, ``ml/plan.py``)."""

import logging
import posixpath
from typing import Any

from hvd_spark._internal.common import retry
from hvd_spark._internal.data.store import (
    Checkpoint,
    Store,
    best_epochs,
    checkpoint_damage,
    end_record_path,
    file_digest,
)

logger = logging.getLogger(__name__)


def early_stop(store: Store, ckpt: Checkpoint | None) -> dict[str, Any] | None:
    """The early stop recorded with an epoch checkpoint (``{"epoch", "epochs", "by"}``: EarlyStopping,
    TerminateOnNaN or a user's ``model.stop_training`` ended training there), or None."""
    if ckpt is None or ckpt.step:
        return None
    stop = store.files.read_json(ckpt.meta_path).get("stopped")
    return stop if isinstance(stop, dict) else None


def write_end_record(store: Store, run_id: str, epoch: int, model_path: str, local: str) -> None:
    """Rank 0, after a fit that trained to its end at ``epoch`` uploaded its model (``local``, now at
    ``model_path``: the callbacks' choice at the end of training, e.g. EarlyStopping's restored best
    weights): the record that makes later attempts and fits of the run return that model."""
    rel = posixpath.relpath(model_path, store.run_path(run_id))
    store.files.write_json(end_record_path(store, run_id, epoch), dict(epoch=epoch, model=rel, **file_digest(local)))


def ended_model(store: Store, run_id: str, ckpt: Checkpoint, *, stopped: bool) -> str:
    """The model a run that ended at ``ckpt`` (its last epoch, or its early stop) returns: the one its
    end record names, when whole; else (a run of an earlier version, a fit that failed between the
    checkpoint and its model, a damaged file) the checkpoint's own model, with a warning for a stop."""
    path = end_record_path(store, run_id, ckpt.epoch)
    try:
        rel = store.files.read_json(path).get("model")
        damage = "it names no model" if not isinstance(rel, str) else None
    except FileNotFoundError:
        rel, damage = None, "the fit ended before writing it"
    except ValueError as e:
        rel, damage = None, f"it does not read as JSON: {retry.one_line(e)}"
    if damage is None:
        model = posixpath.normpath(posixpath.join(store.run_path(run_id), str(rel)))
        damage = checkpoint_damage(store, Checkpoint(ckpt.epoch, model, path), deep=True)
        if damage is None:
            return model
    best = _best_checkpoint(store, run_id, ckpt)
    (logger.warning if stopped else logger.info)(
        "run '%s' ended at epoch %d; the model its fit returned is not available (%s in %s): returning %s",
        run_id,
        ckpt.epoch,
        damage,
        posixpath.basename(path),
        f"the checkpoint of EarlyStopping's best epoch, {best.epoch}, as restore_best_weights does"
        if best is not None
        else "the epoch's checkpoint (without the callbacks' changes at the end of training)",
    )
    return best.model_path if best is not None else ckpt.model_path


def _best_checkpoint(store: Store, run_id: str, ckpt: Checkpoint) -> Checkpoint | None:
    """The checkpoint whose weights an EarlyStopping with ``restore_best_weights`` restores at the end of
    training (its ``best_epoch``, recorded with ``ckpt``: rank/carried.py), when whole; else None."""
    for epoch in best_epochs(store, ckpt):
        found = [c for c in store.checkpoints(run_id) if c.epoch == epoch and not c.step]
        if found and checkpoint_damage(store, found[0], deep=True) is None:
            return found[0]
    return None
