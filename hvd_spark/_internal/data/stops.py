"""An early stop as part of a run's state. When EarlyStopping, TerminateOnNaN or a user's
``model.stop_training`` ends training, rank 0 records the stop with that epoch's checkpoint (its JSON's
``stopped``) and, once the fit's model is uploaded, an end record naming it
(``checkpoints/epoch-NNNN-end.json``). A restart, a resize or a later fit of the run that finds the stop
trains no further and returns that model (``ml/controller.py``, ``ml/plan.py``)."""

import logging
import posixpath
from typing import Any

from hvd_spark._internal.common import retry
from hvd_spark._internal.data.store import Checkpoint, Store, checkpoint_damage, end_record_path, file_digest

logger = logging.getLogger(__name__)


def early_stop(store: Store, ckpt: Checkpoint | None) -> dict[str, Any] | None:
    """The early stop recorded with an epoch checkpoint (``{"epoch", "epochs", "by"}``: EarlyStopping,
    TerminateOnNaN or a user's ``model.stop_training`` ended training there), or None."""
    if ckpt is None or ckpt.step:
        return None
    stop = store.files.read_json(ckpt.meta_path).get("stopped")
    return stop if isinstance(stop, dict) else None


def write_end_record(store: Store, run_id: str, epoch: int, model_path: str, local: str) -> None:
    """Rank 0, after a fit stopped early at ``epoch`` uploaded its model (``local``, now at
    ``model_path``: the callbacks' choice at the end of training, e.g. EarlyStopping's restored best
    weights): the record that makes later attempts and fits of the run return that model."""
    rel = posixpath.relpath(model_path, store.run_path(run_id))
    store.files.write_json(end_record_path(store, run_id, epoch), dict(epoch=epoch, model=rel, **file_digest(local)))


def stopped_model(store: Store, run_id: str, ckpt: Checkpoint) -> str:
    """The model a run stopped early at ``ckpt`` ends with: the one its end record names, when whole;
    else (the fit failed between the checkpoint and its model, or the file is damaged) the
    checkpoint's own model, with a warning."""
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
    logger.warning(
        "run '%s' stopped early at epoch %d; the model it ended with is not available (%s in %s): "
        "returning the epoch's checkpoint (without the callbacks' changes at the end of training, "
        "e.g. EarlyStopping's restore_best_weights)",
        run_id,
        ckpt.epoch,
        damage,
        posixpath.basename(path),
    )
    return ckpt.model_path
