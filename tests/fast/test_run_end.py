"""An early stop as part of a run's state (data/stops.py): recorded with the epoch checkpoint, honoured
by a restart, a resize and a later fit of the run, which return the model the stopped fit ended with.
The ranks are played in process (``EpochWriter`` writes what rank/train.py writes; the rank side is
tested with real ranks in tests/test_early_stop.py)."""

import dataclasses
import logging

import pytest

from hvd_spark._internal.data.stops import early_stop, ended_model, write_end_record
from hvd_spark._internal.data.store import Store, end_record_path, remove_checkpoints_after
from hvd_spark._internal.ml import plan
from hvd_spark._internal.ml.backend import InProcessBackend
from hvd_spark._internal.ml.controller import Controller, State
from hvd_spark._internal.ml.policies import FailurePolicy, FixedScaling
from tests.fast.test_fit_planning import EpochWriter, _config, _fit, _ModelBytes, _plan, _train, tmp_local


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def test_a_stopped_run_is_finished_for_a_later_fit_which_returns_the_model_it_ended_with(store):
    _, trained, _ = _fit(store, "r1", 12, EpochWriter(stop=3))
    assert [h["loss"] for h in trained.results[0]["epoch_logs"]] == [1.0, 0.5, 1 / 3]
    p = _plan(store, "r1")
    assert p.stopped == {"epoch": 3, "epochs": 12, "by": "EarlyStopping"}
    assert p.finished(12) and p.finished(20) and p.finished(3) and p.finished(2)
    # the fit's own model (e.g. EarlyStopping's restored best weights), never the checkpoint's
    assert plan.model_path_of(store, p, 12) == store.model_path("r1", "fit-test")
    assert plan.model_path_of(store, p, 2).endswith("checkpoints/epoch-0002.keras")  # fewer epochs: as before
    writer = EpochWriter()
    trained, backend = _train(store, "r1", 12, writer)  # the controller, asked again: no training job
    assert backend.calls == 0 and writer.seen == []
    assert len(trained.results[0]["epoch_logs"]) == 3


def test_a_restart_after_an_early_stop_trains_no_more(store, caplog):
    writer = EpochWriter(stop=3, fail={"final": OSError("the store went away before the final model")})
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        _, trained, backend = _fit(store, "r1", 12, writer, max_restarts=1)
    assert backend.calls == 1 and trained.restarts == 1  # the restart found the stop: no second training job
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2, 3]
    assert len(trained.results[0]["epoch_logs"]) == 3 and trained.results[0]["stopped"]["by"] == "EarlyStopping"
    # no end record (the fit failed before its model): the epoch's checkpoint, said so
    assert store.files.read_bytes(store.model_path("r1", "fit-test")) == b"weights after epoch 3"
    assert "ended at epoch 3" in caplog.text and "the fit ended before writing it" in caplog.text


def test_a_resize_asked_for_at_the_stop_trains_no_more(store):
    """An attempt whose ranks stopped to grow at the epoch the callbacks stopped (as before rank/cursor.py's
    ResizeCheck deferred to the stop): the next attempt finds the stop and trains nothing."""

    class ResizeAtStop(EpochWriter):
        def __call__(self, cfg):
            result = super().__call__(cfg)
            return {**result, "stopped_for_resize": True} if cfg.start.initial_epoch == 0 else result

    class Growing(FixedScaling):
        resizes = True

        def after_stop(self, backend, size):
            return size

    writer = ResizeAtStop(stop=2)
    cfg = _config(store, "r1", 6)
    cfg = dataclasses.replace(
        cfg, commits=dataclasses.replace(cfg.commits, resize_marker=f"{store.run_path('r1')}/_resize.json")
    )
    c = Controller(
        InProcessBackend(2, rank_fn=writer),
        writer,
        cfg,
        store,
        failure=FailurePolicy(0),
        scaling=Growing(),
        model_bytes=_ModelBytes(),
    )
    trained = c.run()
    assert c.states == [State.SCHEDULING, State.RUNNING, State.RESIZING, State.RUNNING, State.FINISHED]
    assert len(writer.seen) == 1  # one training job
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2]
    assert len(trained.results[0]["epoch_logs"]) == 2


def test_the_end_record_is_checked_and_a_damaged_one_falls_back_to_the_checkpoint(store, caplog):
    _fit(store, "r1", 12, EpochWriter(stop=2))
    ckpt = store.checkpoints("r1")[-1]
    assert early_stop(store, ckpt)["by"] == "EarlyStopping"
    assert early_stop(store, store.checkpoints("r1")[0]) is None
    assert ended_model(store, "r1", ckpt, stopped=True) == store.model_path("r1", "fit-test")
    store.files.write_bytes(store.model_path("r1", "fit-test"), b"another model of another size")
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        assert ended_model(store, "r1", ckpt, stopped=True) == ckpt.model_path
    assert "holds 29 bytes, 11 were written" in caplog.text
    write_end_record(store, "r1", 2, store.model_path("r1", "fit-2"), tmp_local(b"m"))
    store.files.write_bytes(store.model_path("r1", "fit-2"), b"m")
    assert ended_model(store, "r1", ckpt, stopped=True) == store.model_path("r1", "fit-2")


def test_removing_checkpoints_after_one_removes_their_end_records(store):
    _fit(store, "r1", 12, EpochWriter(stop=3))
    assert store.files.exists(end_record_path(store, "r1", 3))
    remove_checkpoints_after(store, "r1", store.checkpoints("r1")[1])
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2]
    assert not store.files.exists(end_record_path(store, "r1", 3))
    assert not _plan(store, "r1").finished(12)  # the stop went with its epoch: the run trains on


def test_the_final_model_recovery_copies_within_the_store_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """An object store (fsspec's memory filesystem: not local): the recovery of a fit that trained every
    epoch and failed before its model copies the last checkpoint within the store; it used to download
    it to a temporary file it never removed."""
    import tempfile
    import uuid

    local_tmp = tmp_path / "tmp"
    local_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(local_tmp))
    store = Store(f"memory://bucket/{uuid.uuid4().hex}")
    assert not store.files.is_local
    writer = EpochWriter(fail={"final": OSError("killed before the final model")})
    _, trained, backend = _fit(store, "r1", 2, writer, max_restarts=1)
    assert backend.calls == 1 and trained.restarts == 1
    assert store.files.read_bytes(store.model_path("r1", "fit-test")) == b"weights after epoch 2"
    assert list(local_tmp.iterdir()) == []


def test_keep_checkpoints_keeps_the_checkpoint_of_early_stoppings_best_weights(store):
    """A restart or resize puts EarlyStopping's best weights back from its best epoch's checkpoint
    (rank/carried.py): retention keeps it, and its end record goes with a pruned checkpoint."""
    import json

    from hvd_spark._internal.data.store import prune_checkpoints

    _fit(store, "r1", 5, EpochWriter())
    newest = store.checkpoints("r1")[-1]
    meta = json.loads(store.files.read_bytes(newest.meta_path))
    state = {"wait": 3, "best": 0.25, "best_epoch": 1, "stopped_epoch": 0, "restore_best_weights": True}
    meta["callbacks"] = [{"class": "EarlyStopping", "state": state}, None]
    store.files.write_json(newest.meta_path, meta)
    write_end_record(store, "r1", 3, store.model_path("r1", "fit-test"), tmp_local(b"final model"))
    removed = prune_checkpoints(store, "r1", 2)
    assert [c.epoch for c in removed] == [1, 3]
    assert [c.epoch for c in store.checkpoints("r1")] == [2, 4, 5]
    assert not store.files.exists(end_record_path(store, "r1", 3))


def test_a_restart_after_the_model_was_uploaded_keeps_it(store):
    """Rank 0 uploaded the fit's model and wrote the end record, then rank 1 failed (a lost task at
    shutdown): the restart trains nothing and keeps that model (before: the last epoch's checkpoint was
    copied over it, losing EarlyStopping's restore or checkpoint_callback's choice)."""
    from hvd_spark._internal.common.outcomes import TASK_LOST
    from hvd_spark._internal.ml.backend import in_process_rank
    from hvd_spark.errors import RankFailedError

    class LostAtShutdown(EpochWriter):
        def __call__(self, cfg):
            result = super().__call__(cfg)
            if in_process_rank().rank == 1 and len(self.seen) == 1:
                raise RankFailedError(1, TASK_LOST, "the executor was lost at shutdown", host="h1")
            return result

    _, trained, backend = _fit(store, "r1", 2, LostAtShutdown(), max_restarts=1)
    assert backend.calls == 1 and trained.restarts == 1
    assert store.files.read_bytes(store.model_path("r1", "fit-test")) == b"final model"
    assert plan.model_path_of(store, _plan(store, "r1"), 2) == store.model_path("r1", "fit-test")
