"""A fit's planning without Spark, Keras or Horovod: which checkpoint a run resumes from, a finished run
returned without training, the restart policy and the errors a user gets. The ranks are played in
process (``InProcessBackend``) by a rank function that writes checkpoints into a local Store as
``rank/train.py`` does (a ``.keras`` file, then the JSON that marks it complete)."""

import json
import logging
import os
import tempfile
import time

import pytest

from hvd_spark._internal.common.contracts import Commits, DataSpec, Reading, RunConfig, Shares, Training
from hvd_spark._internal.common.outcomes import TASK_LOST
from hvd_spark._internal.data.leases import Lease
from hvd_spark._internal.data.stops import write_end_record
from hvd_spark._internal.data.store import Store, checkpoint_names
from hvd_spark._internal.ml import controller, plan
from hvd_spark._internal.ml.backend import InProcessBackend, fit_backend, in_process_rank
from hvd_spark._internal.ml.model_info import architecture_fingerprint
from hvd_spark.errors import (
    JobCancelledError,
    JobTimeoutError,
    LaunchError,
    RankFailedError,
    RankStalledError,
    RunInUseError,
)

ARCH = {
    "model_class": "Sequential",
    "config": {"layers": [{"class_name": "Dense", "config": {"units": 4, "activation": "relu"}}]},
    "weights": [["#0", [[2, 4], [4]]]],
    "optimizer": "SGD",
    "loss": "mse",
    "columns": {"features": ["x"], "labels": ["y"]},
}


class EpochWriter:
    """A rank function with ``rank/train.py``'s effects on the store: rank 0 writes each epoch's
    checkpoint from ``initial_epoch`` on, then the fit's final model. ``fail`` maps an epoch (1-based)
    to ``(rank, exception)``: that rank raises it while training that epoch (once), and the ranks
    played before it stop there, as a real job's ranks wait in the epoch's allreduce."""

    def __init__(self, fail: dict | None = None, stop: int | None = None):
        self.fail = dict(fail or {})
        self.stop = stop  # the epoch (1-based) after which the callbacks stop training, as EarlyStopping does
        self.seen: list[RunConfig] = []

    def __call__(self, cfg: RunConfig) -> dict:
        me = in_process_rank()
        if me.rank == 0:
            self.seen.append(cfg)
        store = Store.from_config(cfg.store)
        history = [dict(h) for h in cfg.start.history_so_far]
        for epoch in range(cfg.start.initial_epoch + 1, cfg.epochs + 1):
            rank, error = self.fail.get(epoch, (None, None))
            if rank == me.rank:
                del self.fail[epoch]
                raise error
            if rank is not None:  # a peer fails in this epoch: its allreduce never completes here
                return {"rank": me.rank, "stopped_at": epoch}
            if me.rank == 0:
                logs = {"loss": 1.0 / epoch}
                history = history[: epoch - 1] + [logs]
                model_name, meta_name = checkpoint_names(epoch)
                folder = store.checkpoints_path(cfg.run_id)
                weights = f"weights after epoch {epoch}".encode()
                store.files.write_bytes(f"{folder}/{model_name}", weights)
                meta = {
                    "epoch": epoch,
                    "logs": logs,
                    "history": history,
                    "time": time.time(),
                    "model_bytes": len(weights),
                }
                if epoch == self.stop:
                    meta["stopped"] = {"epoch": epoch, "epochs": cfg.epochs, "by": "EarlyStopping"}
                store.files.write_json(f"{folder}/{meta_name}", meta)
            if epoch == self.stop:
                break
        if self.fail.get("final") is not None and me.rank == 0:  # trained, then died before the final model
            raise self.fail.pop("final")
        result = {"rank": me.rank, "weights_digest": "same", "size": me.size}
        if me.rank == 0:
            store.files.write_bytes(cfg.commits.final_model, b"final model")
            end = (
                self.stop if self.stop is not None and cfg.start.initial_epoch < self.stop <= cfg.epochs else cfg.epochs
            )
            write_end_record(
                store, cfg.run_id, end, cfg.commits.final_model, tmp_local(b"final model")
            )  # rank/train.py's
            result["epoch_logs"] = history
        return result


def tmp_local(data: bytes) -> str:
    fd, path = tempfile.mkstemp()
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _config(store: Store, run_id: str, epochs: int) -> RunConfig:
    return RunConfig(
        store=store.to_config(),
        run_id=run_id,
        epochs=epochs,
        data=DataSpec((), (), None, (), ()),
        seed=0,
        verbose=0,
        progress_interval=0.0,
        num_threads=1,
        reading=Reading(batch_size=4, val_batch_size=4, shuffle=True, shuffle_buffer_size=16, reader="arrow"),
        training=Training(compile={}),
        shares=Shares(train_files=[["part-0"], ["part-1"]], val_files=None, steps_per_epoch=2, validation_steps=None),
        commits=Commits(final_model=store.model_path(run_id, "fit-test")),
    )


class _ModelBytes:
    """The user's model as the estimator serializes it (counted: only a run without checkpoints needs it)."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return b"the user's model"


def _train(store, run_id, epochs, rank_fn, *, max_restarts=0, num_proc=2, lease=None, model_bytes=None):
    backend = InProcessBackend(num_proc, rank_fn=rank_fn)
    backend_used, fn = fit_backend(backend)
    assert backend_used is backend and fn is rank_fn
    trained = controller.train_with_restarts(
        backend,
        fn,
        _config(store, run_id, epochs),
        store,
        max_restarts=max_restarts,
        model_bytes=model_bytes or _ModelBytes(),
        lease=lease,
    )
    return trained, backend


def _plan(store, run_id, *, arch=ARCH, features=("x",), labels=("y",), legacy="legacy-fp"):
    return plan.plan_resume(
        store,
        run_id,
        fingerprint=architecture_fingerprint(arch),
        architecture=arch,
        feature_cols=list(features),
        label_cols=list(labels),
        legacy_fingerprint=lambda: legacy,
    )


def _fit(store, run_id, epochs, rank_fn=None, **kw):
    """What the estimator does between its checks and its model: plan, record, train."""
    p = _plan(store, run_id)
    plan.record_run(store, p, feature_cols=["x"], label_cols=["y"], data_key="data-1")
    return p, *_train(store, run_id, epochs, rank_fn or EpochWriter(), **kw)


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


# --- the in-process backend ---


def test_in_process_backend_plays_every_rank_in_order():
    seen = []

    def fn(a, b=0):
        me = in_process_rank()
        seen.append((me.rank, me.size, me.env.get("K")))
        return a + b + me.rank

    backend = InProcessBackend(3, env={"K": "base"})
    assert backend.num_processes() == 3
    assert backend.run(fn, args=(10,), kwargs={"b": 5}) == [15, 16, 17]
    assert seen == [(0, 3, "base"), (1, 3, "base"), (2, 3, "base")]
    backend.run(fn, args=(0,), env={"K": "run"})
    assert seen[-1] == (2, 3, "run")
    with pytest.raises(RuntimeError, match="only known inside a function run by InProcessBackend"):
        in_process_rank()


def test_in_process_backend_reports_failures_as_the_launcher_does():
    def fn():
        if in_process_rank().rank == 1:
            raise KeyError("no such column")
        return "ok"

    with pytest.raises(RankFailedError, match=r"rank 1 failed with KeyError: 'no such column'") as info:
        InProcessBackend(3).run(fn)
    assert (info.value.rank, info.value.exc_type) == (1, "KeyError")
    assert "raise KeyError" in info.value.remote_traceback

    stalled = RankStalledError("no progress", ranks=[0], hosts={0: "h"})

    def stall():
        raise stalled

    with pytest.raises(RankStalledError) as raised:
        InProcessBackend(2).run(stall)
    assert raised.value is stalled  # a launcher error passes unchanged


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_in_process_backend_checks_num_proc(bad):
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        InProcessBackend(bad)


# --- resume planning ---


def test_a_new_run_trains_from_the_users_model(store):
    model_bytes = _ModelBytes()
    p, trained, backend = _fit(store, "r1", 3, model_bytes=model_bytes)
    assert p.resume is None and p.history == [] and not p.finished(3)
    run = store.files.read_json(p.run_json)
    assert (run["feature_cols"], run["label_cols"], run["data_key"]) == (["x"], ["y"], "data-1")
    assert run["model_fingerprint"] == architecture_fingerprint(ARCH)
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2, 3]
    assert [r["rank"] for r in trained.results] == [0, 1] and trained.restarts == 0
    assert [h["loss"] for h in trained.results[0]["epoch_logs"]] == [1.0, 0.5, 1.0 / 3]
    assert backend.calls == 1 and model_bytes.calls == 1
    assert store.files.read_bytes(store.model_path("r1", "fit-test")) == b"final model"


def test_a_later_fit_resumes_from_the_latest_checkpoint(store):
    _fit(store, "r1", 2)
    p = _plan(store, "r1")
    assert p.resume is not None and p.resume.epoch == 2 and len(p.history) == 2
    assert not p.finished(5)
    writer = EpochWriter()
    model_bytes = _ModelBytes()
    trained, _ = _train(store, "r1", 5, writer, model_bytes=model_bytes)
    cfg = writer.seen[0]
    assert (cfg.start.initial_epoch, cfg.start.resume_ckpt, cfg.start.model_bytes) == (2, p.resume.model_path, None)
    assert model_bytes.calls == 0  # a resumed run never serializes the user's model
    assert len(trained.results[0]["epoch_logs"]) == 5
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2, 3, 4, 5]


def test_a_run_with_another_architecture_is_refused(store):
    _fit(store, "r1", 1)
    other = dict(ARCH, config={"layers": [{"class_name": "Dense", "config": {"units": 8, "activation": "relu"}}]})
    with pytest.raises(ValueError, match="was trained with another model, optimizer or loss") as info:
        _plan(store, "r1", arch=other)
    message = str(info.value)
    assert "units: 4 -> 8" in message  # what differs
    assert "epoch-0001.keras" in message and "new run_id" in message  # how to warm-start a new run


def test_a_run_with_other_columns_is_refused(store):
    _fit(store, "r1", 1)
    with pytest.raises(ValueError, match=r"run_id 'r1' was trained with feature_cols=\['x'\], label_cols=\['y'\]"):
        _plan(store, "r1", features=("x", "z"))


def test_a_run_without_a_complete_checkpoint_starts_over(store):
    p = _plan(store, "r1")
    plan.record_run(store, p, feature_cols=["x"], label_cols=["y"], data_key="k")
    model_name, _ = checkpoint_names(1)  # a model file without its JSON: not complete
    store.files.write_bytes(f"{store.checkpoints_path('r1')}/{model_name}", b"partial")
    other = dict(ARCH, optimizer="Adam")
    again = _plan(store, "r1", arch=other)  # nothing to continue: another model may start the run
    assert again.resume is None and again.history == []


def test_a_run_recorded_before_architectures_compares_the_coarse_fingerprint(store, caplog):
    _fit(store, "r1", 1)
    run = store.files.read_json(f"{store.run_path('r1')}/run.json")
    del run["architecture"]
    run["model_fingerprint"] = "legacy-fp"
    store.files.write_json(f"{store.run_path('r1')}/run.json", run)
    with caplog.at_level(logging.WARNING):
        assert _plan(store, "r1", legacy="legacy-fp").resume.epoch == 1
    assert "predates full model checks" in caplog.text
    with pytest.raises(ValueError, match="What differs .*: layer types or weight shapes"):
        _plan(store, "r1", legacy="another")


def test_a_finished_run_is_detected_and_not_retrained(store):
    _fit(store, "r1", 3)
    p = _plan(store, "r1")
    assert p.finished(3) and p.finished(2) and not p.finished(4)
    # the model a finished run returns: the asked epoch's checkpoint, never rewritten
    assert plan.model_path_of(store, p, 2).endswith("checkpoints/epoch-0002.keras")
    assert plan.model_path_of(store, p, 3) == store.model_path("r1", "fit-test")  # what the fit returned
    assert plan.model_path_of(store, p, 4) == store.model_path("r1", p.fit_id)
    writer = EpochWriter()
    trained, backend = _train(store, "r1", 3, writer)
    assert backend.calls == 0 and writer.seen == []  # no training job
    assert trained.results[0]["epoch_logs"] == p.history


# --- restarts ---


def test_a_failed_attempt_restarts_from_the_latest_checkpoint(store, caplog):
    writer = EpochWriter(fail={3: (0, OSError("disk full"))})
    model_bytes = _ModelBytes()
    with caplog.at_level(logging.WARNING):
        _, trained, backend = _fit(store, "r1", 4, writer, max_restarts=1, model_bytes=model_bytes)
    assert trained.restarts == 1 and backend.calls == 2
    assert [c.start.initial_epoch for c in writer.seen] == [0, 2]
    assert (
        writer.seen[1].start.resume_ckpt.endswith("epoch-0002.keras") and len(writer.seen[1].start.history_so_far) == 2
    )
    assert model_bytes.calls == 1
    assert [h["loss"] for h in trained.results[0]["epoch_logs"]] == [1.0, 0.5, 1.0 / 3, 0.25]  # each epoch once
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2, 3, 4]
    assert "failed (rank 0 failed with OSError: disk full); restarting (1 of max_restarts=1)" in caplog.text
    assert "from the checkpoint of epoch 2" in caplog.text


def test_when_restarts_run_out_the_user_gets_the_rank_failure(store):
    writer = EpochWriter(fail={1: (1, OSError("disk full")), 2: (1, ValueError("bad row 7"))})
    with pytest.raises(RankFailedError, match=r"rank 1 failed with ValueError: bad row 7") as info:
        _fit(store, "r1", 3, writer, max_restarts=1)
    assert info.value.rank == 1 and "bad row 7" in info.value.remote_message
    assert [c.epoch for c in store.checkpoints("r1")] == [1]  # the second attempt's first epoch was kept


def test_without_restarts_the_first_failure_is_the_users(store):
    writer = EpochWriter(fail={2: (0, OSError("disk full"))})
    with pytest.raises(RankFailedError, match="rank 0 failed with OSError: disk full"):
        _fit(store, "r1", 3, writer)
    assert len(writer.seen) == 1


@pytest.mark.parametrize(
    "error",
    [
        JobTimeoutError("tasks did not start within 600s", ranks=[1]),
        RankStalledError("rank 1 made no progress for 300s", ranks=[1], hosts={1: "h2"}),
        LaunchError("the barrier stage failed"),
        RankFailedError(1, "ProcessDied", "process killed by signal 9", host="h2"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_failures_of_the_job_restart(store, error):
    writer = EpochWriter(fail={2: (1, error)})
    _, trained, backend = _fit(store, "r1", 2, writer, max_restarts=1)
    assert trained.restarts == 1 and backend.calls == 2


def test_a_cancelled_job_is_never_restarted_and_reaches_the_user_unchanged(store):
    cancelled = JobCancelledError("the job group was cancelled")
    writer = EpochWriter(fail={2: (0, cancelled)})
    with pytest.raises(JobCancelledError) as info:
        _fit(store, "r1", 3, writer, max_restarts=5)
    assert info.value is cancelled and len(writer.seen) == 1


def test_a_timeout_after_a_lost_host_names_the_host(store):
    lost = RankFailedError(1, TASK_LOST, "the executor was lost", host="10.0.0.2")
    timeout = JobTimeoutError("2 tasks did not start within 600s", ranks=[0, 1])
    writer = EpochWriter(fail={2: (1, lost), 3: (0, timeout)})
    with pytest.raises(
        JobTimeoutError, match=r"The previous training attempt lost host\(s\) \['10\.0\.0\.2'\]"
    ) as info:
        _fit(store, "r1", 4, writer, max_restarts=1)
    assert info.value.ranks == [0, 1] and info.value.__cause__ is timeout


def test_a_stall_after_a_lost_host_is_reported_as_it_is(store):
    lost = RankFailedError(1, TASK_LOST, "the executor was lost", host="10.0.0.2")
    stalled = RankStalledError("rank 0 made no progress for 300s", ranks=[0], hosts={0: "h1"})
    writer = EpochWriter(fail={2: (1, lost), 3: (0, stalled)})
    with pytest.raises(RankStalledError) as info:
        _fit(store, "r1", 4, writer, max_restarts=1)
    assert info.value is stalled


def test_a_run_taken_over_by_another_fit_fails_with_run_in_use(store):
    lease = Lease(f"{store.run_path('r1')}/_writer.json", "token")
    lease.lost.set()
    writer = EpochWriter(fail={2: (0, OSError("the store went away"))})
    with pytest.raises(RunInUseError, match="was taken over by another fit while this one trained") as info:
        _fit(store, "r1", 3, writer, max_restarts=3, lease=lease)
    assert "Cause: rank 0 failed with OSError: the store went away" in str(info.value)
    assert info.value.run_id == "r1" and len(writer.seen) == 1  # no restart into someone else's run


def test_a_rank_that_finds_the_run_taken_fails_the_fit_with_run_in_use(store):
    writer = EpochWriter(fail={2: (0, RunInUseError("run 'r1' is no longer this fit's to write", run_id="r1"))})
    with pytest.raises(RunInUseError, match="taken over by another fit") as info:
        _fit(store, "r1", 3, writer, max_restarts=3)
    assert isinstance(info.value.__cause__, RankFailedError)
    assert info.value.__cause__.exc_type == "hvd_spark.errors.RunInUseError"


def test_an_attempt_that_trained_every_epoch_only_needs_its_final_model(store):
    writer = EpochWriter(fail={"final": OSError("killed before the final model")})
    _, trained, backend = _fit(store, "r1", 2, writer, max_restarts=1)
    assert backend.calls == 1 and trained.restarts == 1  # no second training job
    final = store.model_path("r1", "fit-test")
    assert store.files.read_bytes(final) == b"weights after epoch 2"  # the last checkpoint, copied
    assert [h["loss"] for h in trained.results[0]["epoch_logs"]] == [1.0, 0.5]
    assert json.loads(store.files.read_bytes(store.checkpoints("r1")[-1].meta_path))["epoch"] == 2
