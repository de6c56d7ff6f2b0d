"""The steps of one fit, on the driver (docs/architecture.md, "One fit, step by step"): :func:`run`
takes the fit's data (``data/fit_data.py``'s ``FitInput``: ``fit(df)``'s DataFrame, or
``fit_on_parquet``'s files), the estimator's checked params (``FitParams``) and its backend object,
and calls one function per step: ``checks.check``, :func:`plan_resume` (then :func:`finished_run`
when the run already has its epochs), :func:`materialize`, :func:`plan_ranks`,
:func:`train_with_restarts`, :func:`verify_and_build`. The steps hand each other small frozen
records (``checks.Checked``, ``plan.ResumePlan``, ``fit_data.Written``, ``RunConfig``); the decisions
that need no Spark are in ``ml/plan.py`` (resume, finished runs) and ``ml/controller.py`` (the training
attempts)."""

import contextlib
import dataclasses
import logging
import time
from typing import Any

import cloudpickle

from hvd_spark._internal.common import dataplan, retry, settings
from hvd_spark._internal.common.contracts import (
    Commits,
    DataSpec,
    FitSummary,
    RankSummary,
    Reading,
    RunConfig,
    Shares,
    Training,
)
from hvd_spark._internal.common.specs import label_shapes, with_stored_names
from hvd_spark._internal.data import fit_data, leases
from hvd_spark._internal.data.fit_data import FitInput, Identified, Written
from hvd_spark._internal.data.stats import check_stats
from hvd_spark._internal.data.store import Store, job_config, prune_checkpoints
from hvd_spark._internal.driver.progress import BATCH_INTERVAL, FitProgress, interactive
from hvd_spark._internal.driver.signals import ends_on_sigterm
from hvd_spark._internal.ml import controller, policies
from hvd_spark._internal.ml import plan as plan_mod
from hvd_spark._internal.ml.backend import fit_backend
from hvd_spark._internal.ml.checks import Checked, check
from hvd_spark._internal.ml.fit_params import FitParams, every_seconds
from hvd_spark._internal.ml.framework import KERAS, Framework
from hvd_spark._internal.ml.transformer import TFTransformer
from hvd_spark.errors import DataChangedError, HvdSparkError, RankFailedError, RunInUseError

logger = logging.getLogger(__name__)


@ends_on_sigterm("the fit")  # SIGTERM: the cancel's clean-up, then the process ends (driver/signals.py)
def run(data: FitInput, p: FitParams, backend_object: Any = None, framework: Framework = KERAS) -> TFTransformer:
    """One fit, step by step: what ``HorovodEstimator.fit(df)`` and ``fit_on_parquet`` both run (and
    ``TorchEstimator``'s, with its ``framework``).

    Args:
        data: what the fit trains on: a DataFrame, or ``fit_on_parquet``'s files.
        p: the estimator's params, checked (``HorovodEstimator._fit_params``).
        backend_object: the estimator's backend object (``backend``), or None.
        framework: the model's framework (``ml/framework.py``): Keras by default.

    Returns:
        The fitted model: a ``TFTransformer`` (Keras) or a ``TorchModel`` (torch).
    """
    t_start = time.time()
    checked = check(data, p, backend_object, framework)
    run_id = checked.p.run_id or plan_mod.new_run_id()
    with run_writer(checked, run_id) as lease:
        return _fit_run(data, checked, run_id, t_start, backend_object, lease)


@contextlib.contextmanager
def run_writer(c: Checked, run_id: str):
    """Step 1b: this fit becomes the run's only writer (a lease in the store, refreshed every
    10 s) until it returns; another fit of the same run meanwhile gets RunInUseError before any
    work. A lease whose fit died (no heartbeat for 60 s) is taken over, so the run resumes."""
    from hvd_spark._internal.data.leases import LeaseHeldError

    store, folder = c.store, c.store.run_path(run_id)
    path, stale = f"{folder}/_writer.json", settings.run_lease_stale()
    with contextlib.ExitStack() as stack:
        if not store.files.exists(folder):

            def remove_if_empty() -> None:  # after the lease is gone: no empty folder left by a failed fit
                # the store is unreachable: an empty folder is harmless, and the fit's outcome comes first
                with contextlib.suppress(Exception), retry.at_most(settings.LEASE_HEARTBEAT):
                    if not store.files.listdir(folder):
                        store.files.rm(folder)

            stack.callback(remove_if_empty)
        try:
            lease = stack.enter_context(
                leases.exclusive_lease(
                    store.files, path, heartbeat=settings.LEASE_HEARTBEAT, stale=stale, run_id=run_id
                )
            )
        except LeaseHeldError as e:
            h = e.holder
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h.get("started", 0) or 0)))
            raise RunInUseError(
                f"run_id '{run_id}' in {store.prefix} is being trained by another fit right now (host "
                f"{h.get('host', '?')}, pid {h.get('pid', '?')}, started {started}, last heartbeat "
                f"{time.time() - float(h.get('heartbeat', 0) or 0):.0f}s ago). Wait for it to finish, or use "
                f"another run_id. A fit that died leaves its lease ({path}); it expires {stale:g}s after its "
                f"last heartbeat ({settings.ENV_RUN_LEASE_STALE}).",
                run_id=run_id,
                holder={k: v for k, v in h.items() if k != "token"},
            ) from None
        yield lease


def _fit_run(data: FitInput, checked: Checked, run_id: str, t_start: float, backend_object: Any, lease=None):
    plan = plan_resume(checked, run_id)
    checked = _read_as_the_run(checked, plan)
    ident = _identify(data, checked)
    plan_mod.check_data(checked.store, plan, ident.record)  # a run goes on with its own data only
    tracker = open_tracking(checked, plan, backend_object)
    try:
        if plan.finished(checked.p.epochs):
            model = finished_run(checked, plan)
        else:
            model = _train_run(data, checked, plan, ident, t_start, backend_object, tracker, lease)
    except BaseException:
        if tracker is not None:
            tracker.close(error=True)
        raise
    if tracker is not None:
        close_tracking(tracker, checked, model)
    return model


def _train_run(
    data: FitInput,
    checked: Checked,
    plan: plan_mod.ResumePlan,
    ident: Identified,
    t_start,
    backend_object,
    tracker,
    lease,
):
    """Steps 3 to 6 of a run that trains: the data, the ranks' plan, the training, the model."""
    written = materialize(data, checked, plan, ident)
    with fit_data.removed_after(checked.store, written):
        cfg = plan_ranks(checked, plan, written, lease)
        listeners = [tracker.on_event] if tracker else []
        try:
            trained = train_with_restarts(
                data.frame.sparkSession, checked, cfg, backend_object, listeners=listeners, lease=lease
            )
            if written.source is not None:  # a file changed under the ranks: no model of mixed data
                from hvd_spark._internal.data.inplace import check_unchanged

                check_unchanged(written.meta["files"], written.source)
            if checked.p.keep_checkpoints is not None:  # the checkpoint it resumed from goes too, now
                try:
                    prune_checkpoints(checked.store, plan.run_id, checked.p.keep_checkpoints)
                except Exception as e:  # housekeeping: the trained model stands; the next fit prunes again
                    logger.warning("could not remove the run's older checkpoints (keep_checkpoints): %s", e)
        except (RankFailedError, DataChangedError) as e:
            changed = isinstance(e, DataChangedError) or e.raised(DataChangedError)
            if not changed:
                raise
            try:
                _drop_fit(checked.store, plan)  # never resumed, returned, nor the run's newest model
            except Exception as drop:  # the store is unreachable: the user's error comes first
                logger.warning("could not remove what the rejected fit wrote: %s", drop)
            message = e.remote_message if isinstance(e, RankFailedError) else str(e)
            if plan.resume is not None:
                message += (
                    f" Run '{plan.run_id}' keeps its checkpoints up to {plan.resume.position}, trained on "
                    "the table before the change; a fit of it on the changed table is refused: fit it "
                    "with a new run_id."
                )
            raise DataChangedError(message) from e
        return verify_and_build(checked, written, cfg, trained, t_start)


def open_tracking(c: Checked, plan: plan_mod.ResumePlan, backend_object: Any = None):
    """MLflow (``mlflow`` param): the run this fit is logged in, or None."""
    from hvd_spark._internal.common.secrets import redacted, url_without_credentials
    from hvd_spark._internal.driver.tracking import FitTracker

    store, run_id = c.store, plan.run_id
    tags = {
        "run_id": run_id,
        "store": url_without_credentials(store.prefix),  # never the storage options (credentials)
        "run_path": store.files.url(store.run_path(run_id)),
        "model_path": store.files.url(plan_mod.model_path_of(store, plan, c.p.epochs, c.framework.suffix)),
        "checkpoints_path": store.files.url(store.checkpoints_path(run_id)),
        "logs_path": store.files.url(store.logs_path(run_id)),
        "resumed_from_epoch": str(plan.resume.epoch if plan.resume else 0),
    }
    params = {k: v for k, v in c.p.as_dict().items() if k not in ("mlflow", "verbose")}
    params["run_id"] = run_id
    if params.get("backend_env"):
        params["backend_env"] = redacted(params["backend_env"])  # the ranks' credentials are never logged
    if backend_object is not None:
        params["backend"] = backend_object
    return FitTracker.open(c.p.mlflow, params, tags)


def close_tracking(tracker, c: Checked, model: TFTransformer) -> None:
    """Logs the epochs the events missed, the fit's summary and the model. A tracking failure here
    is a warning: the trained model is returned either way."""
    from hvd_spark._internal.driver.tracking import signature

    history = model.getHistory()
    epochs = max((len(v) for v in history.values()), default=0)
    epoch_logs = [{k: v[i] for k, v in history.items() if i < len(v)} for i in range(epochs)]
    s = model.getFitSummary()
    summary = (
        {
            "fit_seconds": s.fit_seconds,
            "materialize_seconds": s.materialize_seconds,
            "train_job_seconds": s.train_job_seconds,
            "restarts": s.restarts,
        }
        if s
        else {}
    )
    try:
        tracker.close(
            epoch_logs=epoch_logs, summary=summary, model=model.getModel(), sig=signature(c.inputs, c.outputs)
        )
    except Exception as e:
        logger.warning("MLflow: logging the fit's end to run %s failed: %s", tracker.run_id, e, exc_info=True)


def plan_resume(c: Checked, run_id: str) -> plan_mod.ResumePlan:
    """Step 2: the run id, and the checkpoint to continue from (a run with checkpoints continues
    only with the same architecture and columns): ``plan.plan_resume`` over this model's records."""
    from hvd_spark._internal.ml.model_info import architecture_fingerprint

    p = c.p
    arch, legacy = c.framework.architecture(c)
    return plan_mod.plan_resume(
        c.store,
        run_id,
        fingerprint=architecture_fingerprint(arch),
        architecture=arch,
        feature_cols=p.feature_cols,
        label_cols=p.label_cols,
        legacy_fingerprint=legacy,
    )


def _read_as_the_run(c: Checked, plan: plan_mod.ResumePlan) -> Checked:
    """``c`` copying the data when the run's table fell back to a copy (``plan.copy_again``)."""
    reason = plan_mod.copy_again(plan, c.p.materialize) if c.source is not None else None
    if reason is None:
        return c
    logger.info("copying the data to the store, as run '%s' did: %s", plan.run_id, reason)
    return dataclasses.replace(c, source=None, copy_reason=reason)


def _identify(data: FitInput, c: Checked) -> Identified:
    """Step 2b (``fit_data.identify``): what names the fit's data, for the run's record."""
    return fit_data.identify(
        data.frame,
        c.source,
        c.validation,
        random_seed=c.p.random_seed,
        sample_weight_col=c.p.sample_weight_col,
        copy_reason=c.copy_reason,
    )


def finished_run(c: Checked, plan: plan_mod.ResumePlan) -> TFTransformer:
    """A run that already has the requested epochs: its model, without training."""
    assert plan.resume is not None
    epochs, stop = c.p.epochs, plan.stopped
    if stop is not None and epochs >= plan.resume.epoch:
        logger.info(
            "run '%s' was stopped early at epoch %d of %s by %s; returning the model it ended with, without "
            "training (a new run_id trains again)",
            plan.run_id,
            plan.resume.epoch,
            stop.get("epochs"),
            stop.get("by"),
        )
    else:
        logger.info(
            "run '%s' already has %d of %d epochs; returning its model without training",
            plan.run_id,
            plan.resume.epoch,
            epochs,
        )
    model_path = plan_mod.model_path_of(c.store, plan, epochs)  # the asked epoch's checkpoint: never rewritten
    return _transformer(c, model_path, plan.run_id, plan.history[:epochs])


def materialize(data: FitInput, c: Checked, plan: plan_mod.ResumePlan, ident: Identified) -> Written:
    """Step 3: the data written to Parquet in the store in one pass over the input, its values
    checked (nulls, lengths, class indices) in the same pass; or the same data, written before and
    provably unchanged, reused (``reuse_data``); or a table read in place, scanned for its statistics
    (``fit_data.scan_in_place`` / ``fit_data.copy``). ``ident``: step 2b's record (a table that turns
    out not to be readable in place is checked against the run again, as a copy, before it is written)."""
    seed = c.p.random_seed
    num_proc = c.options.num_proc
    named_f, named_l, (w_info,) = with_stored_names(c.f_infos, c.l_infos, [c.w_info])
    f_infos = [i for i in named_f if i is not None]  # features and labels are never None
    l_infos = [i for i in named_l if i is not None]
    t0 = time.time()
    indices = c.framework.class_indices(c)
    shapes = label_shapes(c.p.label_shapes, c.outputs, indices)  # per-step class indices: (12,) for (12, 3)
    spec = DataSpec(tuple(f_infos), tuple(l_infos), w_info, tuple(c.inputs), tuple(c.outputs), shapes)

    def check(stats: dict) -> None:
        check_stats(stats, f_infos, l_infos, w_info, c.inputs, c.outputs, c.validation, num_proc, indices)

    if c.source is not None:  # the ranks read the table's own files: one pass for the statistics, no copy
        from hvd_spark._internal.data import inplace

        source = fit_data.table_source(c.source, f_infos, l_infos, w_info, c.validation, seed)
        reuse = c.p.reuse_data != "never"
        try:
            spark = data.frame.sparkSession
            return fit_data.scan_in_place(
                spark,
                c.store,
                c.source[0],
                source,
                spec,
                ident.record,
                reuse=reuse,
                check=check,
                options=c.options,
                seed=seed,
                t0=t0,
            )
        except inplace.NotReadableInPlace as e:
            if c.p.materialize == "never" or data.given:
                raise ValueError(f"The table cannot be read in place: {str(e).rstrip('.')}.") from None
            logger.warning("copying the data to the store: it cannot be read in place because %s", e)
            c = dataclasses.replace(c, source=None, copy_reason=str(e))
            ident = _identify(data, c)
            ident = dataclasses.replace(ident, record=dict(ident.record, fell_back=True))  # _read_as_the_run
            plan_mod.check_data(c.store, plan, ident.record)  # the copy splits its own way
    return fit_data.copy(
        data.frame,
        c.store,
        spec,
        ident,
        validation=c.validation,
        seed=seed,
        reuse_data=c.p.reuse_data,
        num_proc=num_proc,
        slots=c.options.slots,
        partitions_per_process=c.p.partitions_per_process,
        check=check,
        t0=t0,
    )


def plan_ranks(c: Checked, plan: plan_mod.ResumePlan, w: Written, lease=None) -> RunConfig:
    """Step 4: files per rank, steps per epoch, the run's record and the run configuration."""
    p, meta, num_proc = c.p, w.meta, c.options.num_proc
    if (len(meta["train_files"]) < num_proc and p.reader == "petastorm") or meta["train_rows"] < num_proc:
        logger.warning(
            "%d training rows in %d file(s) for %d processes: some ranks read the same rows",
            meta["train_rows"],
            len(meta["train_files"]),
            num_proc,
        )
    units = _rank_units(c, w)
    # a new run, or one that failed before its first checkpoint: what it trains
    split_rows = {"train": meta["train_rows"], "val": meta["val_rows"]}
    plan_mod.record_run(
        c.store,
        plan,
        feature_cols=p.feature_cols,
        label_cols=p.label_cols,
        data_key=w.key,
        data=dict(w.record, rows=split_rows) if w.record is not None else None,
    )
    cfg = controller.sized(_run_config(c, plan, w, units, lease), num_proc)
    logger.info(
        "training run '%s' on %d ranks: %d train rows, %d val rows, %d steps/epoch, batch %d per rank",
        plan.run_id,
        num_proc,
        meta["train_rows"],
        meta["val_rows"],
        cfg.shares.steps_per_epoch,
        p.batch_size,
    )
    return cfg


def _rank_units(c: Checked, w: Written):
    """What the ranks read: the training files, and the row groups of each split (empty: by files)."""
    meta = w.meta
    train_paths = tuple(path for path, _ in meta["train_files"])
    units: tuple[tuple[int, int, int], ...] = ()
    val_units: tuple[tuple[int, int, int], ...] = ()
    if w.source is not None:  # the table's own files: row groups with rows of each split
        train_paths = tuple(meta["files"])
        units = tuple((f, g, t) for f, g, t, _ in meta["units"] if t)
        val_units = tuple((f, g, v) for f, g, _, v in meta["units"] if v)
    elif c.p.reader == "arrow":  # the data plan: every rank reads its share of any row group
        units = tuple(
            (u.file, u.group, u.rows) for u in dataplan.row_groups(train_paths, c.store.files.parquet_metadata)
        )
    return train_paths, units, val_units


def _run_config(c: Checked, plan: plan_mod.ResumePlan, w: Written, units: tuple, lease) -> RunConfig:
    """The run configuration, before it is sized for the ranks (``controller.sized``); ``units``: what
    :func:`_rank_units` gave."""
    p, meta = c.p, w.meta
    train_paths, train_units, val_units = units
    every = p.checkpoint_every
    return RunConfig(
        store=job_config(c.store),
        run_id=plan.run_id,
        epochs=p.epochs,
        data=w.data,
        seed=w.seed,
        verbose=p.verbose,
        progress_interval=BATCH_INTERVAL if p.verbose and interactive() else 0.0,
        num_threads=c.options.num_threads,
        reading=Reading(
            batch_size=p.batch_size,
            val_batch_size=p.val_batch,
            shuffle=p.shuffle,
            shuffle_buffer_size=p.shuffle_buffer_size,
            reader=p.reader,
            train_paths=train_paths,
            train_units=train_units,
            train_table=tuple((path, int(rows)) for path, rows in meta["train_files"]),
            val_table=tuple((path, int(rows)) for path, rows in meta["val_files"])
            if meta["val_rows"] and w.source is None
            else (),
            source=w.source,
            val_units=val_units,
            fixed_steps=p.train_steps_per_epoch,
            fixed_val_steps=p.validation_steps_per_epoch,
            validation_exact=p.validation_steps_per_epoch is None,
            prefetch=p.tensorflow_dataset_prefetch_buffer_size,
            reader_workers=(1, 1)
            if p.reader_pool_type == "dummy"
            else (p.train_reader_num_workers, p.val_reader_num_workers),
            transformation_fn=cloudpickle.dumps(p.transformation_fn) if p.transformation_fn else None,
            cache_all=p.inmemory_cache_all,
        ),
        training=Training(
            compile=c.framework.compile_args(c, meta.get("stats")),
            custom_objects=cloudpickle.dumps(c.custom_objects) if c.custom_objects else None,
            callbacks=cloudpickle.dumps(list(p.callbacks)) if p.callbacks else None,
            checkpoint_callback=cloudpickle.dumps(p.checkpoint_callback) if p.checkpoint_callback else None,
            backward_passes_per_step=p.backward_passes_per_step,
            compression=p.gradient_compression,
            class_weight=p.class_weight,
            validation_freq=tuple(p.validation_freq) if isinstance(p.validation_freq, list) else p.validation_freq,
        ),
        shares=Shares(train_files=[], val_files=None, steps_per_epoch=1, validation_steps=None),  # controller.sized's
        commits=Commits(
            final_model=c.store.model_path(plan.run_id, plan.fit_id, suffix=c.framework.suffix),
            lease=(lease.path, lease.token) if lease is not None else None,
            checkpoint_steps=every if isinstance(every, int) else None,
            checkpoint_seconds=every_seconds(every),
            keep_checkpoints=p.keep_checkpoints,
            kept_from=plan.resume.epoch if plan.resume is not None else None,
            resize_marker=f"{c.store.run_path(plan.run_id)}/_resize.json" if p.elastic else None,
        ),
    )


def train_with_restarts(
    spark, c: Checked, cfg: RunConfig, backend_object: Any = None, *, listeners=(), lease=None
) -> controller.Trained:
    """Step 5: the training attempts (``controller.train_with_restarts``), each through the fit's backend:
    a Spark barrier stage running ``rank/train.py``'s ``train`` by default (``backend.fit_backend``).

    Returns the ranks' results, the number of restarts, the seconds the attempts took and the
    recoveries (restarts and resizes).
    """
    store = c.store
    probe = controller.AttemptProbe()
    progress = FitProgress(c.p.verbose, bar=cfg.progress_interval > 0, listeners=[*listeners, probe])
    backend, rank_fn = fit_backend(
        backend_object,
        c.framework.rank_fn(),
        spark=spark,
        options=c.options,
        on_event=progress,
        description=c.framework.description,
        channel=(store, f"{store.run_path(cfg.run_id)}/_live"),  # progress on Spark Connect
    )
    elastic = None
    if c.p.elastic:
        elastic = policies.Elastic(
            min_num_proc=c.p.min_num_proc or 1,
            max_num_proc=c.p.max_num_proc,
            timeout=settings.ELASTIC_TIMEOUT.get(c.p.elastic_timeout),
            poll=settings.ELASTIC_POLL.get(),
            initial=c.p.num_proc,
        )
    trained = controller.train_with_restarts(
        backend,
        rank_fn,
        cfg,
        store,
        max_restarts=c.p.max_restarts,
        model_bytes=lambda: c.framework.model_bytes(c),
        lease=lease,
        elastic=elastic,
        probe=probe,
    )
    return trained


def verify_and_build(c: Checked, w: Written, cfg: RunConfig, trained: controller.Trained, t_start) -> TFTransformer:
    """Step 6: every rank ended with the same weights (what proves the averaging); the model."""
    results, restarts, t_train = trained.results, trained.restarts, trained.seconds

    digests = {r["weights_digest"] for r in results}
    if len(digests) > 1:
        raise HvdSparkError(
            f"Ranks ended training with different weights ({len(digests)} distinct digests); "
            "gradient averaging did not hold. Please report this with your model."
        )
    epoch_logs = results[0]["epoch_logs"]
    start = results[0].get("startup") or {}
    if start:
        logger.info(
            "rank 0 started %s: process %.2fs, horovod init %.2fs, model %.2fs, data %.2fs; first step %.2fs, "
            "the rest of the first epoch %.2fs",
            "warm (forked)" if start.get("warm") else "cold (fresh process)",
            *(start.get(k, 0.0) for k in ("process", "horovod_init", "model", "data", "first_step", "first_epoch")),
        )
    logger.info(
        "fit of run '%s' took %.1fs (materialize %.1fs, training job %.1fs)",
        cfg.run_id,
        time.time() - t_start,
        w.seconds,
        t_train,
    )
    summary = FitSummary(
        run_id=cfg.run_id,
        data_key=w.key,
        steps_per_epoch=cfg.shares.steps_per_epoch,
        restarts=restarts,
        materialize_seconds=w.seconds,
        train_job_seconds=t_train,
        fit_seconds=time.time() - t_start,
        ranks=tuple(RankSummary.from_result(r) for r in sorted(results, key=lambda r: r["rank"])),
        recoveries=trained.recoveries,
    )
    model = _transformer(c, cfg.commits.final_model, cfg.run_id, epoch_logs)
    model._fit_summary = summary
    return model


def _transformer(c: Checked, model_path: str, run_id: str, epoch_logs: list) -> TFTransformer:
    """The fitted model: the trained (or finished run's) file, with the fit's columns and specs."""
    return c.framework.transformer(c, model_path, run_id, epoch_logs)


def _drop_fit(store: Store, plan: plan_mod.ResumePlan) -> None:
    """Removes what a fit rejected with DataChangedError wrote that would pass for a result: its final
    model (``Store.model_path(run_id)`` would return it and ``Store.runs()`` count it) and its checkpoints
    and commits (resumed from, or returned as a finished run's model). Its callbacks' outputs and logs
    stay: they say what happened."""
    with contextlib.suppress(FileNotFoundError):
        store.files.rm(store.model_path(plan.run_id, plan.fit_id))
    _drop_checkpoints_after(store, plan)


def _drop_checkpoints_after(store: Store, plan: plan_mod.ResumePlan) -> None:
    """Removes the checkpoints and commits a fit wrote (those after the checkpoint it resumed from): they
    hold a model trained on a table that changed under it."""
    from hvd_spark._internal.data.store import remove_checkpoints_after

    remove_checkpoints_after(store, plan.run_id, plan.resume)
