"""The decisions of a fit that need no Spark, Keras or Horovod: which checkpoint a run resumes from
(and whether it may), whether the run is already finished, and the training attempts with their
restarts and the errors a user gets.

Everything here reads and writes the run's folder in the :class:`Store` (``run.json``, the
checkpoints, the final model) and takes the model as plain data: its architecture record and
fingerprints are computed by the caller (``ml/model_info.py``). The ranks run through a backend of
horovod.spark's shape (``ml/backend.py``), so the fast tests drive this module with ranks played in
process.
"""

import contextlib
import dataclasses
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common import retry
from hvd_spark._internal.common.contracts import Recovery, RunConfig
from hvd_spark._internal.common.restarts import LOST_HOST_TYPES, RESTARTABLE, should_restart
from hvd_spark._internal.data.store import Checkpoint, Lease, Store
from hvd_spark._internal.ml.model_info import architecture_diff
from hvd_spark.errors import JobTimeoutError, NotEnoughSlotsError, RankFailedError, RankStalledError, RunInUseError

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
    run_data: dict | None = None  # a resumed run's data record (run.json's "data"; None: recorded before them)

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
    latest = store.latest_checkpoint(run_id, set_aside=True)  # the fit holds the run lease here
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
        run_data = info.get("data")
    else:
        run_data = None
    return ResumePlan(
        run_id, fingerprint, run_json, resume, history, architecture, fit_id or new_fit_id(), run_data=run_data
    )


def model_path_of(store: Store, plan: ResumePlan, epochs: int) -> str:
    """Where the model a fit returns lives: its own file, or for a finished run the checkpoint of the
    asked epoch (never rewritten; the latest one when that epoch's is gone)."""
    if plan.finished(epochs):
        assert plan.resume is not None
        at_epoch = {ck.epoch: ck for ck in store._epoch_checkpoints(plan.run_id)}
        asked = at_epoch.get(epochs)
        damage = store._checkpoint_damage(asked, deep=True) if asked is not None else "it is gone"
        if damage is None and asked is not None:
            return asked.model_path
        logger.warning(
            "run '%s': the checkpoint of epoch %d cannot be returned (%s); returning the newest, of %s",
            plan.run_id,
            epochs,
            damage,
            plan.resume.position,
        )
        return plan.resume.model_path
    return store.model_path(plan.run_id, plan.fit_id)


def record_run(
    store: Store, plan: ResumePlan, *, feature_cols: Any, label_cols: Any, data_key: str, data: dict | None = None
) -> None:
    """Writes ``run.json`` (what the run trains: the model, the columns, the data record ``data`` of
    :func:`check_data`) for a new run, or one that failed before its first checkpoint; a resumed run
    keeps its own (one recorded before data records gets this fit's, which it continues on)."""
    if plan.resume is not None:
        if plan.run_data is None and data is not None:
            info = store._read_json(plan.run_json) if store._exists(plan.run_json) else {}
            store._write_json(plan.run_json, dict(info, data=data))
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
            "data": data,
        },
    )


# --- a run's data ---------------------------------------------------------------------------------
# A run trains on one data set, split one way. Its run.json records what names that data (the
# estimator builds the record; nothing here needs Spark):
#   read: "in place" (the table's own files) or "copied" (written to the store)
#   in place: table, root (the split hashes file paths below it), files [[url, bytes, mtime ms], ...]
#   copied: identified (False: an RDD, a cache or a source without identity: "why"), query (a digest
#       of the optimized plan without expression ids), rows_in_plan (semanticHash of a plan that holds
#       its rows), files [[path, bytes, mtime ms], ...] (the input files), why_copied
#   both: validation, random_seed (for a fraction), validation_files (fit_on_parquet),
#       sample_weight_col, rows {"train": n, "val": n} (once written).
# Never the layout (ranks, files per rank, partitions): an elastic or resized run keeps its data.

_SPLIT_KEYS = (
    ("validation", "validation"),
    ("random_seed", "random_seed (the validation split's seed)"),
    ("validation_files", "validation_path's files"),
    ("sample_weight_col", "sample_weight_col"),
)


def _read_how(record: dict) -> str:
    if record.get("read") == "in place":
        return (
            f"the table at {record.get('root') or record.get('table')} read in place ({len(record.get('files') or ())} "
            "files; validation rows drawn by file and row number)"
        )
    why = f", because {record['why_copied']}" if record.get("why_copied") else ""
    return f"a copy in the store (validation rows drawn by the rows' values{why})"


def _below(root: str, url: str) -> str:
    """A file's name for a message: its path below the table's folder, as the split names it."""
    from hvd_spark._internal.common.sources import split_key

    return split_key(root, url) if root else url


def _path(url: str) -> str:
    """A URL without its scheme (``file:/x`` and ``file:///x``, ``s3a://b/k`` and ``s3://b/k`` are one
    file), as the split names files (``sources.split_key``)."""
    u = urllib.parse.urlparse(url or "")
    return (u.netloc + u.path if u.scheme else url or "").rstrip("/")


def _files_diff(before: list, now: list, root: str, what: str) -> list[str]:
    """What changed among files given as [url, bytes, mtime ms]: added, removed, changed (size or time)."""
    old = {_path(f[0]): (int(f[1]), int(f[2])) for f in before}
    new = {_path(f[0]): (int(f[1]), int(f[2])) for f in now}

    def names(urls: list[str]) -> str:
        shown = ", ".join(_below(root, u) for u in sorted(urls)[:3])
        return shown + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")

    out = []
    for verb, urls in (
        ("added", [u for u in new if u not in old]),
        ("removed", [u for u in old if u not in new]),
        ("changed in size or modification time", [u for u in new if u in old and new[u] != old[u]]),
    ):
        if urls:
            out.append(f"{what} {verb}: {names(urls)}")
    return out


def _given(value: Any) -> Any:
    return None if value is None or value == "" or value == [] else value  # unset, however recorded


def copy_again(plan: ResumePlan, materialize: str) -> str | None:
    """Why a resumed run copies its data instead of reading its table in place, or None: a run whose
    table turned out not to be readable in place (step 3's scan fell back to a copy) is copied again,
    without trying the scan, so that its data is read and split as before (``materialize="never"``
    still reads in place, and is refused by :func:`check_data` when the split differs)."""
    run = plan.run_data or {}
    if plan.resume is None or not run.get("fell_back") or materialize == "never":
        return None
    return str(run.get("why_copied") or "the run's data was copied")


def _fraction(record: dict) -> bool:
    """Whether the record's validation split is a random fraction (which depends on how rows are read:
    by file and row number in place, by the rows' values in a copy)."""
    v = record.get("validation")
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def comparable(record: dict) -> bool:
    """Whether the record names its rows (files with their identity, or rows held in the plan)."""
    return record.get("read") == "in place" or bool(record.get("identified"))


def data_differences(run: dict, fit: dict) -> list[str]:
    """What differs between a run's data record and a fit's (run -> fit), in words; [] when nothing
    that could be compared does. The rows are compared only when both records name them."""
    if run.get("read") != fit.get("read") and (_fraction(run) or _fraction(fit)):
        return [f"read: {_read_how(run)} -> {_read_how(fit)} (materialize='always' or 'never' reads as the run did)"]
    out = [
        f"{label}: {run.get(key)!r} -> {fit.get(key)!r}"
        for key, label in _SPLIT_KEYS
        if _given(run.get(key)) != _given(fit.get(key))
    ]
    if not (comparable(run) and comparable(fit)):
        return out
    if run.get("read") != fit.get("read"):  # no random split: the same files give the same rows either way
        return out + _files_diff(run.get("files") or [], fit.get("files") or [], "", "input files")
    if run["read"] == "in place":
        if _path(run.get("root") or "") != _path(fit.get("root") or ""):
            out.append(
                f"the table's folder (the split hashes file paths below it): {run.get('root')} -> {fit.get('root')}"
            )
        out += _files_diff(run.get("files") or [], fit.get("files") or [], run.get("root") or "", "files of the table")
        return out
    if run.get("query") != fit.get("query"):
        out.append("the DataFrame's query (its sources, filters, columns or computations)")
    elif run.get("rows_in_plan") != fit.get("rows_in_plan"):
        out.append("the DataFrame's query or the rows held in it (createDataFrame of other rows)")
    out += _files_diff(run.get("files") or [], fit.get("files") or [], "", "input files")
    return out


def check_data(store: Store, plan: ResumePlan, record: dict) -> None:
    """A resumed or finished run continues only on its own data, split the same way: ``record`` (this
    fit's data) against the run's. Where the rows cannot be compared (data without an identity: an RDD,
    a cache, a source hvd_spark cannot list; a run recorded before data records), a warning says so and
    the fit goes on. Reads nothing, writes nothing.

    Raises:
        ValueError: the data differs; the message names the run, what differs, and how to go on (a new
            run, warm-started from this run's weights, or this run on its own data).
    """
    if plan.resume is None:
        return
    run = plan.run_data
    if run is None:
        logger.warning(
            "run '%s' was recorded before runs recorded their data: this fit's data (%s) cannot be compared with "
            "the run's; it continues on it",
            plan.run_id,
            _read_how(record),
        )
        return
    diff = data_differences(run, record)
    if diff:
        rows = run.get("rows") or {}
        trained = f"{rows.get('train')} training and {rows.get('val')} validation rows of " if rows else ""
        raise ValueError(
            f"run_id '{plan.run_id}' in {store.prefix} was trained on other data; a run continues only on the data it "
            "started with, split the same way (else its validation rows become training rows, and its epochs and "
            f"history mix two data sets). What differs (run -> this fit): {'; '.join(diff)}. The run trained on "
            f"{trained}{_read_how(run)}. To train on this data, start a new run (another run_id, or none), "
            "warm-started from this run's weights: "
            f"old = keras.models.load_model('{store._url(plan.resume.model_path)}'); "
            "model.set_weights(old.get_weights()), then fit with a new run_id. To continue this run, fit it on its "
            "own data, read and split as before."
        )
    if not (comparable(run) and comparable(record)):
        why = record.get("why") if not comparable(record) else run.get("why")
        logger.warning(
            "run '%s': the rows of %s data cannot be compared (%s); how they are read and split is the same. "
            "Make sure this is the run's data: a run continues only on the data it started with",
            plan.run_id,
            "this fit's" if not comparable(record) else "the run's",
            why or "no identity",
        )


def sized(cfg: RunConfig, num_proc: int) -> RunConfig:
    """``cfg`` for an attempt on ``num_proc`` ranks: training files per rank (the petastorm reader),
    validation files per rank (each file read by exactly one rank), steps per epoch (each rank's share
    of an epoch once, or the user's ``train_steps_per_epoch``) and validation steps."""
    from hvd_spark._internal.common.dataplan import steps_for
    from hvd_spark._internal.common.specs import assign_files, steps_per_epoch

    train_rows = sum(r for _, r in cfg.train_table)
    val_rows = sum(r for _, r in cfg.val_table) + sum(u[2] for u in cfg.val_units)
    train_files = assign_files(list(cfg.train_table), num_proc)[0] if cfg.train_table else cfg.train_files
    if cfg.val_units:  # a table read in place: each rank reads its share of the validation rows (train.py)
        val_files: list | None = [[] for _ in range(num_proc)]
    else:
        val_files = assign_files(list(cfg.val_table), num_proc, share=False)[0] if val_rows else None
    if cfg.fixed_steps:
        steps = cfg.fixed_steps
    elif cfg.train_units:  # the planned reader: each rank reads floor(rows / ranks) rows once
        steps = max(1, steps_for(train_rows // num_proc, cfg.batch_size))
    else:
        steps = steps_per_epoch(train_rows, cfg.batch_size, num_proc)
    val_steps = (cfg.fixed_val_steps or steps_per_epoch(val_rows, cfg.val_batch_size, num_proc)) if val_files else None
    return dataclasses.replace(
        cfg, train_files=train_files, val_files=val_files, steps_per_epoch=int(steps), validation_steps=val_steps
    )


@dataclasses.dataclass(frozen=True)
class Elastic:
    """Elastic training's bounds: at least ``min_num_proc`` ranks, at most ``max_num_proc`` (None: every
    task slot); fail after ``timeout`` seconds with fewer slots than ``min_num_proc``. ``poll``: seconds
    between slot counts; ``settle``: seconds a count must hold before a job is sized by it (an executor
    that just died may still be counted)."""

    min_num_proc: int
    max_num_proc: int | None
    timeout: float
    poll: float = 2.0
    settle: float = 3.0
    initial: int | None = None  # the first attempt's ranks at most (the estimator's num_proc)

    def size_for(self, slots: int) -> int:
        return slots if self.max_num_proc is None else min(slots, self.max_num_proc)


class AttemptProbe:
    """What the driver hears from rank 0 of the running attempt (an ``on_event`` listener): when it
    finished its first step and the optimizer step it last reported (``position`` events)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.first_step_at: float | None = None
        self.iterations: int | None = None

    def new_attempt(self) -> None:
        self.first_step_at = None
        self.iterations = None

    def __call__(self, rank: int, payload: dict) -> None:
        if payload.get("kind") != "position":
            return
        if self.first_step_at is None:
            self.first_step_at = float(payload.get("time") or self.clock())
        self.iterations = int(payload.get("iterations", 0))


def _slots_of(backend: Any) -> int:
    count = getattr(backend, "available_slots", None)
    if count is None:
        raise NotImplementedError(
            f"elastic training needs a backend that counts its task slots (available_slots()); "
            f"{type(backend).__name__} has none."
        )
    return int(count())


def wait_for_slots(backend: Any, elastic: Elastic, why: str, sleep: Callable[[float], None] = time.sleep) -> int:
    """The ranks of the next attempt: the task slots now (up to ``max_num_proc``), once at least
    ``min_num_proc`` have held for ``settle`` seconds.

    Raises:
        NotEnoughSlotsError: fewer than ``min_num_proc`` slots for ``timeout`` seconds.
        ValueError: at once, on a master whose slots never change (``local[N]``) with too few of them.
    """
    fixed = getattr(backend, "fixed_slots", lambda: None)()
    if fixed is not None and fixed < elastic.min_num_proc:
        raise ValueError(
            f"min_num_proc={elastic.min_num_proc} is more than the {fixed} task slots of this local master, which "
            "never change: lower min_num_proc, or use a cluster master."
        )
    t0 = time.monotonic()
    seen_low = None
    while True:
        slots = _slots_of(backend)
        if slots >= elastic.min_num_proc:
            if elastic.settle > 0:
                sleep(elastic.settle)
                slots = min(slots, _slots_of(backend))
            if slots >= elastic.min_num_proc:
                return elastic.size_for(slots)
        seen_low = slots if seen_low is None else min(seen_low, slots)
        waited = time.monotonic() - t0
        if waited >= elastic.timeout:
            raise NotEnoughSlotsError(
                f"{why}: the application has {slots} task slot(s) (at least {seen_low} over {waited:.0f}s); "
                f"elastic training needs min_num_proc={elastic.min_num_proc} "
                f"(max_num_proc={elastic.max_num_proc}) and waited elastic_timeout={elastic.timeout:g}s. "
                "Add executors, or lower min_num_proc.",
                slots=slots,
                min_num_proc=elastic.min_num_proc,
            )
        if waited == 0 or int(waited) % 30 < elastic.poll:
            logger.warning(
                "%s: %d task slot(s), fewer than min_num_proc=%d; waiting up to %.0fs more",
                why,
                slots,
                elastic.min_num_proc,
                elastic.timeout - waited,
            )
        sleep(min(elastic.poll, max(0.0, elastic.timeout - waited)))


class _GrowWatch:
    """While an attempt runs on fewer ranks than it could, counts the task slots every ``poll`` seconds;
    once more exist it writes the resize marker (``cfg.resize_marker``), which rank 0 reads at the next
    epoch end and all ranks then stop there together."""

    def __init__(self, backend: Any, elastic: Elastic, store: Store, marker: str, size: int):
        self.backend, self.elastic, self.store, self.marker, self.size = backend, elastic, store, marker, size
        self._stop = threading.Event()
        self.asked: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="hvd_spark-grow-watch")

    def __enter__(self):
        if self.elastic.max_num_proc is None or self.size < self.elastic.max_num_proc:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.store._rm(self.marker)
        return False

    def _run(self) -> None:
        failed: set[str] = set()  # the store's errors already logged: one warning each, not one per poll
        while not self._stop.wait(self.elastic.poll):
            try:
                target = self.elastic.size_for(_slots_of(self.backend))
            except Exception as e:  # counting failed this time: try again at the next poll
                logger.debug("counting task slots failed: %s", e)
                continue
            if target > self.size:
                if self._stop.is_set():
                    return  # the attempt ended meanwhile: no marker for the next one
                try:
                    with retry.at_most(self.elastic.poll):  # the next poll tries again
                        self.store._write_json(self.marker, {"size": target, "time": time.time()})
                except Exception as e:  # the store failed this time: try again at the next poll
                    error = f"{type(e).__name__}: {getattr(e, 'cause', e)}"  # one warning per cause
                    if error not in failed:
                        failed.add(error)
                        logger.warning(
                            "%d task slots available, but writing the resize marker %s failed (%s); training "
                            "grows once a write succeeds (tried again every %gs)",
                            target,
                            self.marker,
                            error,
                            self.elastic.poll,
                        )
                    continue
                self.asked = target
                logger.info(
                    "%d task slots available: training grows from %d to %d ranks at the next epoch end",
                    target,
                    self.size,
                    target,
                )
                return


@dataclasses.dataclass(frozen=True)
class Trained:
    """What the training attempts of a fit ended with."""

    results: list[dict]  # the last attempt's per-rank results, in rank order
    restarts: int  # failed attempts that were started again
    seconds: float  # the attempts' time, launch to end
    recoveries: tuple[Recovery, ...] = ()  # every restart and resize, in order


def _with_backend_size(backend: Any, num_proc: int) -> Any:
    resize = getattr(backend, "with_num_proc", None)
    if resize is None:
        raise NotImplementedError(
            f"elastic training needs a backend that runs any number of ranks (with_num_proc(n)); "
            f"{type(backend).__name__} has none."
        )
    return resize(num_proc)


def _commit_iterations(store: Store, ckpt: Checkpoint | None) -> int:
    if ckpt is None:
        return 0
    try:
        return int(store._read_json(ckpt.meta_path).get("iterations") or 0)
    except FileNotFoundError:
        return 0


def train_with_restarts(
    backend: Any,
    rank_fn: Callable[..., Any],
    cfg: RunConfig,
    store: Store,
    *,
    max_restarts: int,
    model_bytes: Callable[[], bytes],
    lease: Lease | None = None,
    elastic: Elastic | None = None,
    probe: AttemptProbe | None = None,
) -> Trained:
    """One ``backend.run(rank_fn, args=(cfg,))`` per attempt, each from the latest complete checkpoint
    or commit (none: from the user's model, ``model_bytes()``); a failed attempt starts again when
    ``restarts.should_restart`` says so.

    With ``elastic``, each attempt runs on the task slots there are (``wait_for_slots``): after a loss
    the next attempt has fewer ranks, and while an attempt has fewer than it could, a watch asks it to
    stop at the next epoch end so that the next one grows (not counted as a restart). Every restart and
    resize is logged and returned as a :class:`Recovery`.

    Raises:
        RunInUseError: another fit took the run over meanwhile (this fit's writer ``lease`` was lost,
            or a rank found the run's lease not its own).
        JobTimeoutError: as the backend raised it; after an attempt that lost hosts, the message says so.
        NotEnoughSlotsError: elastic, and fewer than ``min_num_proc`` slots for ``elastic.timeout``.
        RankFailedError, LaunchError, RankStalledError: the backend's, when no restart is left.
        JobCancelledError: never restarted.
    """
    run_id = cfg.run_id
    t0 = time.time()
    cached_model: bytes | None = None
    restarts = 0
    lost_hosts: set[str] = set()  # hosts whose executor or network went away in a failed attempt
    probe = probe or AttemptProbe()
    recoveries: list[Recovery] = []
    pending: dict | None = None  # the recovery under way: completed with the next attempt's first step
    if elastic is None:
        size = backend.num_processes()
    else:
        size = wait_for_slots(backend, elastic, "starting")
        size = min(size, elastic.initial) if elastic.initial else size
        backend = _with_backend_size(backend, size)
    cfg = sized(cfg, size) if cfg.train_table else cfg

    def close_pending() -> None:
        nonlocal pending
        if pending is None:
            return
        failed_at = pending.pop("failed_at")
        seconds = probe.first_step_at - failed_at if probe.first_step_at else None
        recovery = Recovery(**pending, seconds=seconds)
        recoveries.append(recovery)
        logger.warning("recovery: %s", recovery.describe())
        pending = None

    while True:
        resume = store.latest_checkpoint(run_id, set_aside=True)  # this fit holds the run: damaged ones aside
        if resume is not None:
            logger.info("resuming run '%s' from %s of %d epochs", run_id, resume.position, cfg.epochs)
        elif cached_model is None:
            cached_model = model_bytes()
        meta = store._read_json(resume.meta_path) if resume else {}
        cfg = dataclasses.replace(
            cfg,
            initial_epoch=resume.epoch if resume else 0,
            resume_ckpt=resume.model_path if resume else None,
            history_so_far=tuple(meta.get("history", ())) if resume else (),
            model_bytes=None if resume else cached_model,
            resume_step=resume.step if resume else 0,
            resume_cursor=meta.get("cursor") if resume else None,
        )
        if resume is not None and resume.epoch >= cfg.epochs:
            # The failed attempt had finished training; only the final model was missing.
            store._upload_file(store._local_copy(resume.model_path), cfg.final_model)
            results = [{"rank": 0, "weights_digest": "", "epoch_logs": list(cfg.history_so_far)}]
            close_pending()
            return Trained(results, restarts, time.time() - t0, tuple(recoveries))
        probe.new_attempt()
        if cfg.resize_marker:  # a request left by an earlier attempt (or fit) is not this attempt's
            store._rm(cfg.resize_marker)
        grow = (
            _GrowWatch(backend, elastic, store, cfg.resize_marker, size)
            if elastic is not None and cfg.resize_marker
            else contextlib.nullcontext()
        )
        try:
            try:
                with grow:
                    results = list(backend.run(rank_fn, args=(cfg,)))
            except JobTimeoutError as e:
                if not lost_hosts or isinstance(e, RankStalledError):
                    raise
                raise JobTimeoutError(
                    f"{e} The previous training attempt lost host(s) {sorted(lost_hosts)}; the application "
                    "has fewer task slots until they return.",
                    ranks=e.ranks,
                ) from e
        except RESTARTABLE as e:
            failed_at = time.time()
            if (lease is not None and lease.lost.is_set()) or (
                isinstance(e, RankFailedError) and e.exc_type.endswith("RunInUseError")
            ):
                raise RunInUseError(
                    f"run_id '{run_id}' in {store.prefix} was taken over by another fit while this one trained "
                    f"(its writer lease {store.run_path(run_id)}/_writer.json is no longer this fit's); this fit "
                    f"stopped before writing another checkpoint. Cause: {str(e).splitlines()[0]}",
                    run_id=run_id,
                ) from e
            lost_now: tuple[str, ...] = ()
            if isinstance(e, RankFailedError) and e.exc_type in LOST_HOST_TYPES and e.host:
                lost_hosts.add(e.host)
                lost_now = (e.host,)
            if not should_restart(e, restarts, max_restarts):
                raise
            close_pending()  # the recovery before this attempt (its time unknown when it never made a step)
            restarts += 1
            latest = store.latest_checkpoint(run_id)
            reached = probe.iterations
            redone = max(0, reached - _commit_iterations(store, latest)) if reached is not None else None
            logger.warning(
                "training attempt %d of run '%s' failed (%s); restarting (%d of max_restarts=%d) from %s",
                restarts,
                run_id,
                # a timeout's or stall's whole report (where each rank was); a failure's first line
                str(e) if isinstance(e, JobTimeoutError) else str(e).splitlines()[0],
                restarts,
                max_restarts,
                f"the checkpoint of {latest.position}" if latest else "the start",
            )
            new_size = size
            if elastic is not None:
                new_size = wait_for_slots(backend, elastic, f"after the failure of attempt {restarts}")
                if lost_now and new_size >= size and size - 1 >= elastic.min_num_proc:
                    # Spark may still count the lost executor (it drops one that stopped answering only
                    # after spark.network.timeout): go on with one rank fewer; growing adds it back.
                    new_size = size - 1
                backend = _with_backend_size(backend, new_size)
                cfg = sized(cfg, new_size)
            pending = dict(
                kind="restart" if new_size == size else ("shrink" if new_size < size else "grow"),
                cause=str(e).splitlines()[0][:300],
                from_size=size,
                to_size=new_size,
                resumed_from=latest.position if latest else "the start",
                steps_redone=redone,
                lost_hosts=lost_now,
                failed_at=failed_at,
            )
            size = new_size
            continue
        close_pending()
        if elastic is not None and any(r.get("stopped_for_resize") for r in results):
            latest = store.latest_checkpoint(run_id)
            new_size = wait_for_slots(backend, elastic, "growing")
            pending = dict(
                kind="grow" if new_size > size else "restart",
                cause=f"task slots came back ({new_size} usable)",
                from_size=size,
                to_size=new_size,
                resumed_from=latest.position if latest else "the start",
                steps_redone=0,
                lost_hosts=(),
                failed_at=time.time(),
            )
            size = new_size
            backend = _with_backend_size(backend, size)
            cfg = sized(cfg, size)
            continue
        return Trained(results, restarts, time.time() - t0, tuple(recoveries))
