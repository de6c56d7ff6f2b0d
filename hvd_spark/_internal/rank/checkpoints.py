"""Rank 0's checkpoints in the store, for every framework: the Keras ranks' ``CheckpointCallback``
(``fit_callbacks.py``) and the torch ranks (``torch_train.py``) write them through :class:`RunCommits`.

The model file is uploaded first and the JSON after it, each atomically; a checkpoint counts as complete
once its JSON exists, so a crash while committing leaves the previous one the latest. Before writing, the
run's writer lease must still be this fit's and the checkpoint must not exist: a fit that lost its run to
another (a stalled or cancelled one) stops with ``RunInUseError`` instead of writing into it, and a run
never holds more epochs than asked. No Keras or torch here.
"""

import os
import time
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common.events import busy


class RunCommits:
    """Writes a run's checkpoints: ``save(local_path)`` writes the model file (with its optimizer state)."""

    def __init__(
        self,
        store,
        run_id: str,
        tmp: str,
        lease: tuple[str, str] | None = None,
        epochs: int | None = None,
        *,
        suffix: str = ".keras",
        keep: int | None = None,
        kept_from: int | None = None,
    ):
        self.store, self.run_id, self.tmp = store, run_id, tmp
        self.lease, self.epochs, self.suffix = lease, epochs, suffix
        self.keep, self.kept_from = keep, kept_from

    def check_still_ours(self, epoch: int, meta_path: str, what: str) -> None:
        from hvd_spark.errors import RunInUseError

        if self.epochs is not None and epoch > self.epochs:
            raise RunInUseError(f"run '{self.run_id}' asked for {self.epochs} epochs; not writing epoch {epoch}.")
        if self.lease is not None:
            path, token = self.lease
            try:
                held = self.store.files.read_json(path)
            except FileNotFoundError:
                held = None
            if held is None or held.get("token") != token:
                who = f"host {held.get('host')}, pid {held.get('pid')}" if held else "nobody (released)"
                raise RunInUseError(
                    f"run '{self.run_id}' is no longer this fit's to write: its writer lease is held by {who}. "
                    f"The checkpoint of {what} was not written.",
                    run_id=self.run_id,
                )
        if self.store.files.exists(meta_path):
            raise RunInUseError(
                f"the checkpoint of {what} of run '{self.run_id}' was written by another fit meanwhile; "
                "not overwriting it.",
                run_id=self.run_id,
            )

    def write(self, epoch: int, step: int, meta: dict, save: Callable[[str], Any], iterations: int) -> None:
        """The checkpoint after ``epoch`` epochs and ``step`` steps of the next one; ``meta``: its JSON's
        other fields (logs, history, cursor, callbacks' state, the early stop)."""
        from hvd_spark._internal.data.store import (
            checkpoint_names,
            file_digest,
            prune_checkpoints,
            remove_commits_before,
        )

        what = f"epoch {epoch} step {step}" if step else f"epoch {epoch}"
        with busy(f"saving the checkpoint of {what}"):  # a large model to an object store: slow, not stalled
            model_name, meta_name = checkpoint_names(epoch, step, self.suffix)
            ckpt_dir = self.store.checkpoints_path(self.run_id)
            self.check_still_ours(epoch if step == 0 else epoch + 1, f"{ckpt_dir}/{meta_name}", what)
            local = os.path.join(self.tmp, model_name)
            save(local)
            written = file_digest(local)  # the JSON records them: a damaged upload is never resumed from
            self.store.files.upload_file(local, f"{ckpt_dir}/{model_name}")
            meta = dict(meta, epoch=epoch, step=step, iterations=int(iterations), **written)
            self.store.files.write_json(f"{ckpt_dir}/{meta_name}", dict(meta, time=time.time()))
            os.remove(local)
            remove_commits_before(self.store, self.run_id, epoch, step)
            if self.keep is not None and step == 0:  # after the new one is whole (its JSON last)
                prune_checkpoints(self.store, self.run_id, self.keep, also=self.kept_from)
