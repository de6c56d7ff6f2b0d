"""The decisions of a fit before it trains that need no Spark, Keras or Horovod: which checkpoint a
run resumes from (and whether it may), whether the run is already finished, and whether the run's
data is the data it started with. The training attempts themselves are ``ml/controller.py``'s.

Everything here reads and writes the run's folder in the :class:`Store` (``run.json``, the
checkpoints, the final model) and takes the model as plain data: its architecture record and
fingerprints are computed by the caller (``ml/model_info.py``), so the fast tests drive this module
without Spark.
"""

import dataclasses
import logging
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.data.stops import ended_model
from hvd_spark._internal.data.store import Checkpoint, Store, checkpoint_damage, epoch_checkpoints
from hvd_spark._internal.ml.model_info import architecture_diff

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
    stopped: dict | None = None  # the early stop recorded with ``resume`` (data/stops.py): the run trains no more

    def finished(self, epochs: int) -> bool:
        """Whether the run already has ``epochs`` epochs, or was stopped early by its callbacks: the fit
        returns its model without training."""
        return self.resume is not None and (self.resume.epoch >= epochs or self.stopped is not None)


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
    if latest is not None and store.files.exists(run_json):
        info = store.files.read_json(run_json)
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
                f"old = keras.models.load_model('{store.files.url(latest.model_path)}'); "
                "model.set_weights(old.get_weights()) (where the shapes agree), then fit with a new run_id."
            )
        resume = latest
        meta = store.files.read_json(resume.meta_path)
        history, run_data = meta["history"], info.get("data")
        stopped = meta.get("stopped") if not resume.step and isinstance(meta.get("stopped"), dict) else None
    else:
        run_data = stopped = None
    fit_id = fit_id or new_fit_id()
    return ResumePlan(run_id, fingerprint, run_json, resume, history, architecture, fit_id, run_data, stopped)


def model_path_of(store: Store, plan: ResumePlan, epochs: int, suffix: str = ".keras") -> str:
    """Where the model a fit returns lives: its own file, or for a finished run the model the fit that
    ended it returned (its end record: data/stops.py), or for fewer epochs the checkpoint of the asked
    epoch (never rewritten; the latest one when that epoch's is gone)."""
    if plan.finished(epochs):
        assert plan.resume is not None
        if epochs >= plan.resume.epoch and not plan.resume.step:  # the model the fit that ended the run returned
            return ended_model(store, plan.run_id, plan.resume, stopped=plan.stopped is not None)
        at_epoch = {ck.epoch: ck for ck in epoch_checkpoints(store, plan.run_id)}
        asked = at_epoch.get(epochs)
        damage = checkpoint_damage(store, asked, deep=True) if asked is not None else "it is gone"
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
    return store.model_path(plan.run_id, plan.fit_id, suffix=suffix)


def record_run(
    store: Store, plan: ResumePlan, *, feature_cols: Any, label_cols: Any, data_key: str, data: dict | None = None
) -> None:
    """Writes ``run.json`` (what the run trains: the model, the columns, the data record ``data`` of
    :func:`check_data`) for a new run, or one that failed before its first checkpoint; a resumed run
    keeps its own (one recorded before data records gets this fit's, which it continues on)."""
    if plan.resume is not None:
        if plan.run_data is None and data is not None:
            info = store.files.read_json(plan.run_json) if store.files.exists(plan.run_json) else {}
            store.files.write_json(plan.run_json, dict(info, data=data))
        return
    store.files.write_json(
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
            f"old = keras.models.load_model('{store.files.url(plan.resume.model_path)}'); "
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
