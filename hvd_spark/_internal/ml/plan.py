"""The decisions of a fit that need no Spark, Keras or Horovod: which checkpoint a run resumes from
(and whether it may), whether the run is already finished, and the training attempts with their
restarts and the errors a user gets.

Everything here reads and writes the run's folder in the :class:`Store` (``run.json``, the
checkpoints, the final model) and takes the model as plain data: its architecture record and
fingerprints are computed by the caller (``ml/model_info.py``). The ranks run through a backend of
horovod.spark's shape (``ml/backend.py``), so the fast tests drive this module with ranks played in
process.
"""

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.common.restarts import LOST_HOST_TYPES, RESTARTABLE, should_restart
from hvd_spark._internal.data.store import Checkpoint, Lease, Store
from hvd_spark._internal.ml.model_info import architecture_diff
from hvd_spark.errors import JobTimeoutError, RankFailedError, RankStalledError, RunInUseError

logger = logging.getLogger(__name__)


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def new_fit_id() -> str:
    return f"fit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """The run and the checkpoint it continues from (None: from the start)."""

    run_id: str
    fingerprint: str
    run_json: str
    resume: Checkpoint | None
    history: list
    architecture: dict | None = None
    fit_id: str = ""  # this fit's own name: its final model is runs/<run_id>/models/<fit_id>.keras

    def finished(self, epochs: int) -> bool:
        """Whether the run already has ``epochs`` epochs: the fit returns its model without training."""
        return self.resume is not None and self.resume.epoch >= epochs


def plan_resume(
    store: Store,
    run_id: str,
    *,
    fingerprint: str,
    architecture: dict | None,
    feature_cols: Any,
    label_cols: Any,
    legacy_fingerprint: Callable[[], str],
    fit_id: str | None = None,
) -> ResumePlan:
    """Where a fit of ``run_id`` starts: a run with complete checkpoints continues from its latest one,
    only with the same columns and the same model, optimizer and loss (``fingerprint`` of
    ``architecture``; a run recorded before architectures were, by ``legacy_fingerprint()``: layer
    types and weight shapes). A run without checkpoints starts from the start.

    Raises:
        ValueError: the run was trained with other columns or another model; the message says what
            differs and how to warm-start a new run from this one's weights.
    """
    run_json = f"{store.run_path(run_id)}/run.json"
    latest = store.latest_checkpoint(run_id)
    resume = None
    history: list[dict] = []
    if latest is not None and store._exists(run_json):
        info = store._read_json(run_json)
        if info.get("feature_cols") != feature_cols or info.get("label_cols") != label_cols:
            raise ValueError(
                f"run_id '{run_id}' was trained with feature_cols={info.get('feature_cols')}, "
                f"label_cols={info.get('label_cols')}. Received: feature_cols={feature_cols}, "
                f"label_cols={label_cols}. Use a new run_id for different columns."
            )
        if "architecture" in info:
            differs = info.get("model_fingerprint") != fingerprint
            diff = architecture_diff(info["architecture"], architecture or {}) if differs else []
        else:  # a run started before the whole architecture was recorded: its coarser fingerprint
            differs = info.get("model_fingerprint") != legacy_fingerprint()
            diff = ["layer types or weight shapes"] if differs else []
            if not differs:
                logger.warning(
                    "run '%s' predates full model checks: only its layer types and weight shapes were compared",
                    run_id,
                )
        if differs:
            raise ValueError(
                f"run_id '{run_id}' in {store.prefix} was trained with another model, optimizer or loss; "
                f"a run continues only with what it started with. What differs (run -> this fit): "
                f"{'; '.join(diff) or 'the model'}. Start a new run (another run_id, or none), or "
                "warm-start one from this run's weights: "
                f"old = keras.models.load_model('{store._url(latest.model_path)}'); "
                "model.set_weights(old.get_weights()) (where the shapes agree), then fit with a new run_id."
            )
        resume = latest
        history = store._read_json(resume.meta_path)["history"]
    return ResumePlan(run_id, fingerprint, run_json, resume, history, architecture, fit_id or new_fit_id())


def model_path_of(store: Store, plan: ResumePlan, epochs: int) -> str:
    """Where the model a fit returns lives: its own file, or for a finished run the checkpoint of the
    asked epoch (never rewritten; the latest one when that epoch's is gone)."""
    if plan.finished(epochs):
        assert plan.resume is not None
        at_epoch = {ck.epoch: ck.model_path for ck in store.checkpoints(plan.run_id)}
        return at_epoch.get(epochs, plan.resume.model_path)
    return store.model_path(plan.run_id, plan.fit_id)


def record_run(store: Store, plan: ResumePlan, *, feature_cols: Any, label_cols: Any, data_key: str) -> None:
    """Writes ``run.json`` (what the run trains) for a new run, or one that failed before its first
    checkpoint; a resumed run keeps its own."""
    if plan.resume is not None:
        return
    store._write_json(
        plan.run_json,
        {
            "run_id": plan.run_id,
            "model_fingerprint": plan.fingerprint,
            "architecture": plan.architecture,
            "feature_cols": feature_cols,
            "label_cols": label_cols,
            "created": time.time(),
            "data_key": data_key,
        },
    )


@dataclasses.dataclass(frozen=True)
class Trained:
    """What the training attempts of a fit ended with."""

    results: list[dict]  # the last attempt's per-rank results, in rank order
    restarts: int  # failed attempts that were started again
    seconds: float  # the attempts' time, launch to end


def train_with_restarts(
    backend: Any,
    rank_fn: Callable[..., Any],
    cfg: RunConfig,
    store: Store,
    *,
    max_restarts: int,
    model_bytes: Callable[[], bytes],
    lease: Lease | None = None,
) -> Trained:
    """One ``backend.run(rank_fn, args=(cfg,))`` per attempt, each from the latest complete checkpoint
    (none: from the user's model, ``model_bytes()``); a failed attempt starts again when
    ``restarts.should_restart`` says so.

    Raises:
        RunInUseError: another fit took the run over meanwhile (this fit's writer ``lease`` was lost,
            or a rank found the run's lease not its own).
        JobTimeoutError: as the backend raised it; after an attempt that lost hosts, the message says so.
        RankFailedError, LaunchError, RankStalledError: the backend's, when no restart is left.
        JobCancelledError: never restarted.
    """
    run_id = cfg.run_id
    t0 = time.time()
    cached_model: bytes | None = None
    restarts = 0
    lost_hosts: set[str] = set()  # hosts whose executor or network went away in a failed attempt
    while True:
        resume = store.latest_checkpoint(run_id)
        if resume is not None:
            logger.info("resuming run '%s' from epoch %d of %d", run_id, resume.epoch, cfg.epochs)
        elif cached_model is None:
            cached_model = model_bytes()
        cfg = dataclasses.replace(
            cfg,
            initial_epoch=resume.epoch if resume else 0,
            resume_ckpt=resume.model_path if resume else None,
            history_so_far=tuple(store._read_json(resume.meta_path)["history"]) if resume else (),
            model_bytes=None if resume else cached_model,
        )
        if resume is not None and resume.epoch >= cfg.epochs:
            # The failed attempt had finished training; only the final model was missing.
            store._upload_file(store._local_copy(resume.model_path), cfg.final_model)
            results = [{"rank": 0, "weights_digest": "", "epoch_logs": list(cfg.history_so_far)}]
            return Trained(results, restarts, time.time() - t0)
        try:
            try:
                results = backend.run(rank_fn, args=(cfg,))
            except JobTimeoutError as e:
                if not lost_hosts or isinstance(e, RankStalledError):
                    raise
                raise JobTimeoutError(
                    f"{e} The previous training attempt lost host(s) {sorted(lost_hosts)}; the application "
                    "has fewer task slots until they return.",
                    ranks=e.ranks,
                ) from e
            return Trained(list(results), restarts, time.time() - t0)
        except RESTARTABLE as e:
            if (lease is not None and lease.lost.is_set()) or (
                isinstance(e, RankFailedError) and e.exc_type.endswith("RunInUseError")
            ):
                raise RunInUseError(
                    f"run_id '{run_id}' in {store.prefix} was taken over by another fit while this one trained "
                    f"(its writer lease {store.run_path(run_id)}/_writer.json is no longer this fit's); this fit "
                    f"stopped before writing another checkpoint. Cause: {str(e).splitlines()[0]}",
                    run_id=run_id,
                ) from e
            if isinstance(e, RankFailedError) and e.exc_type in LOST_HOST_TYPES and e.host:
                lost_hosts.add(e.host)
            if not should_restart(e, restarts, max_restarts):
                raise
            restarts += 1
            latest = store.latest_checkpoint(run_id)
            logger.warning(
                "training attempt %d of run '%s' failed (%s); restarting (%d of max_restarts=%d) from %s",
                restarts,
                run_id,
                # a timeout's or stall's whole report (where each rank was); a failure's first line
                str(e) if isinstance(e, JobTimeoutError) else str(e).splitlines()[0],
                restarts,
                max_restarts,
                f"the checkpoint of epoch {latest.epoch}" if latest else "the start",
            )
