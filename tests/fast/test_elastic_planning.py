"""Elastic training's decisions without Spark (ml/controller.py, ml/policies.py): each attempt sized
by the task slots there are, a smaller attempt after a lost executor, growing back at an epoch end
once slots return, the error after too long with too few slots, and the recoveries a fit reports.
Ranks are played in process by ``InProcessBackend``, whose ``slots`` a test changes as Spark's
would change."""

import dataclasses
import time

import pytest

from hvd_spark._internal.common.outcomes import TASK_LOST
from hvd_spark._internal.data.files import StoreFiles
from hvd_spark._internal.data.store import Store, checkpoint_names, epoch_checkpoints
from hvd_spark._internal.ml import controller, policies
from hvd_spark._internal.ml.backend import InProcessBackend, in_process_rank
from hvd_spark.errors import NotEnoughSlotsError, RankFailedError
from tests.fast.test_fit_planning import _config, _ModelBytes

FAST = dict(poll=0.05, settle=0.0)


class ElasticWriter:
    """``rank/train.py``'s effects as an elastic fit has them: rank 0 writes each epoch's checkpoint
    (with the optimizer's step count), every rank stops after an epoch when the driver's resize marker
    is there (``ResizeCheck``); ``events`` maps an epoch (1-based) to what happens in it."""

    def __init__(self, backend: InProcessBackend, events: dict):
        self.backend, self.events = backend, dict(events)
        self.sizes: list[int] = []

    def __call__(self, cfg):
        me = in_process_rank()
        store = Store.from_config(cfg.store)
        if me.rank == 0:
            self.sizes.append(me.size)
        for epoch in range(cfg.start.initial_epoch + 1, cfg.epochs + 1):
            event = self.events.get(epoch)
            if event in ("lose", "lose-still-counted") and me.rank == me.size - 1:
                del self.events[epoch]
                if event == "lose":
                    self.backend.slots = me.size - 1  # its executor is gone with it
                raise RankFailedError(me.rank, TASK_LOST, "the executor was lost", host="10.0.0.9")
            if event in ("lose", "lose-still-counted") and me.rank < me.size - 1:
                return {"rank": me.rank}  # its peer fails: the epoch's allreduce never completes
            if me.rank == 0:
                folder = store.checkpoints_path(cfg.run_id)
                model_name, meta_name = checkpoint_names(epoch)
                store.files.write_bytes(f"{folder}/{model_name}", b"w")
                history = [{"loss": 1.0 / e} for e in range(1, epoch + 1)]
                store.files.write_json(
                    f"{folder}/{meta_name}", {"history": history, "iterations": 10 * epoch, "model_bytes": 1}
                )
            if event == "return" and me.rank == 0:
                del self.events[epoch]
                self.backend.slots = self.backend.slots + 1
                deadline = time.monotonic() + 5
                while not store.files.exists(cfg.commits.resize_marker) and time.monotonic() < deadline:
                    time.sleep(0.02)
            if epoch < cfg.epochs and cfg.commits.resize_marker and store.files.exists(cfg.commits.resize_marker):
                return {"rank": me.rank, "stopped_for_resize": True}
        result = {"rank": me.rank, "weights_digest": "same"}
        if me.rank == 0:
            store.files.write_bytes(cfg.commits.final_model, b"final")
            result["epoch_logs"] = [{"loss": 1.0 / e} for e in range(1, cfg.epochs + 1)]
        return result


def _elastic_cfg(store, run_id, epochs):
    cfg = _config(store, run_id, epochs)
    return dataclasses.replace(
        cfg,
        reading=dataclasses.replace(cfg.reading, train_table=(("part-0", 40), ("part-1", 40), ("part-2", 40))),
        commits=dataclasses.replace(cfg.commits, resize_marker=f"{store.run_path(run_id)}/_resize.json"),
    )


def _without_marker(cfg):
    return dataclasses.replace(cfg, commits=dataclasses.replace(cfg.commits, resize_marker=None))


def _run(store, backend, writer, epochs, *, max_restarts=1, cfg=None, **elastic):
    return controller.train_with_restarts(
        backend,
        writer,
        cfg or _elastic_cfg(store, "r", epochs),
        store,
        max_restarts=max_restarts,
        model_bytes=_ModelBytes(),
        elastic=policies.Elastic(**{**FAST, "timeout": 5, **elastic}),
    )


def test_a_lost_executor_shrinks_the_job_and_returning_slots_grow_it(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    writer = ElasticWriter(backend, {2: "lose", 3: "return"})
    trained = _run(store, backend, writer, 5, min_num_proc=2, max_num_proc=3)
    assert writer.sizes == [3, 2, 3]  # lost one rank in epoch 2, grew back after epoch 3
    assert [r.kind for r in trained.recoveries] == ["shrink", "grow"]
    shrink, grow = trained.recoveries
    assert (shrink.from_size, shrink.to_size, shrink.resumed_from) == (3, 2, "epoch 1")
    assert shrink.lost_hosts == ("10.0.0.9",)
    assert (grow.from_size, grow.to_size, grow.resumed_from, grow.steps_redone) == (2, 3, "epoch 3", 0)
    assert trained.restarts == 1  # growing is no restart
    assert [c.epoch for c in epoch_checkpoints(store, "r")] == [1, 2, 3, 4, 5]
    assert not store.files.exists(f"{store.run_path('r')}/_resize.json")  # the marker does not outlive the attempt


def test_each_attempt_is_sized_for_its_ranks(tmp_path):
    store = Store(str(tmp_path))
    cfg = _elastic_cfg(store, "r", 1)
    cfg = controller.sized(
        dataclasses.replace(cfg, reading=dataclasses.replace(cfg.reading, val_table=(("v0", 10), ("v1", 5)))), 2
    )
    assert (
        cfg.shares.steps_per_epoch == 15 and len(cfg.shares.train_files) == 2 and len(cfg.shares.val_files) == 2
    )  # 120 rows / 2 / 4
    cfg = controller.sized(cfg, 3)
    assert cfg.shares.steps_per_epoch == 10 and len(cfg.shares.train_files) == 3
    assert sorted(len(f) for f in cfg.shares.val_files) == [0, 1, 1]  # each validation file read by one rank


def test_too_few_slots_for_too_long_is_a_clear_error_within_the_bound(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    backend.slots = 1
    t0 = time.monotonic()
    with pytest.raises(NotEnoughSlotsError) as err:
        _run(store, backend, ElasticWriter(backend, {}), 2, min_num_proc=2, max_num_proc=3, timeout=0.5)
    assert time.monotonic() - t0 < 5  # the bound, not the training's timeouts
    assert "1 task slot(s)" in str(err.value) and "min_num_proc=2" in str(err.value)
    assert (err.value.slots, err.value.min_num_proc) == (1, 2)
    assert backend.calls == 0  # no attempt started


def test_slots_that_return_within_the_bound_start_the_job(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(2)
    counts = iter([1, 1, 2, 2, 2, 2, 2, 2, 2, 2])
    backend.slots = lambda: next(counts, 2)
    trained = _run(store, backend, ElasticWriter(backend, {}), 1, min_num_proc=2, max_num_proc=None)
    assert backend.sizes == [2] and trained.recoveries == ()


def test_a_backend_without_slot_counts_cannot_be_elastic(tmp_path):
    class Plain:
        def num_processes(self):
            return 2

        def run(self, fn, args=(), kwargs=None, env=None):
            raise AssertionError("not reached")

    store = Store(str(tmp_path))
    with pytest.raises(NotImplementedError, match="available_slots"):
        controller.train_with_restarts(
            Plain(),
            lambda cfg: None,
            _elastic_cfg(store, "r", 1),
            store,
            max_restarts=1,
            model_bytes=_ModelBytes(),
            elastic=policies.Elastic(min_num_proc=1, max_num_proc=2, timeout=1, **FAST),
        )


def test_every_recovery_is_reported_when_losses_follow_each_other(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    writer = ElasticWriter(backend, {2: "lose", 4: "lose"})
    trained = _run(store, backend, writer, 5, max_restarts=2, min_num_proc=1, max_num_proc=3)
    assert writer.sizes == [3, 2, 1] and trained.restarts == 2
    assert [(r.kind, r.from_size, r.to_size, r.resumed_from) for r in trained.recoveries] == [
        ("shrink", 3, 2, "epoch 1"),
        ("shrink", 2, 1, "epoch 3"),
    ]


def test_a_lost_executor_that_spark_still_counts_is_left_out(tmp_path):
    """Spark drops an executor that stopped answering only after spark.network.timeout: the next attempt
    has one rank fewer than the stale count says, and grows back once the count is true again."""
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    writer = ElasticWriter(backend, {2: "lose-still-counted"})
    _run(store, backend, writer, 3, min_num_proc=2, max_num_proc=3)
    assert writer.sizes[:2] == [3, 2]


def test_the_first_attempt_starts_with_num_proc_ranks_at_most(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    writer = ElasticWriter(backend, {})
    _run(
        store,
        backend,
        writer,
        1,
        max_restarts=1,
        cfg=_without_marker(_elastic_cfg(store, "r", 1)),
        min_num_proc=1,
        max_num_proc=3,
        initial=2,
    )
    assert writer.sizes == [2]


class _MarkerWritesFail(StoreFiles):
    """A store's files whose first ``failures`` writes of the resize marker fail (the store was down
    for a few polls), and which work again after."""

    def __init__(self, root: str, failures: int):
        super().__init__(root, {}, None)
        self.failures, self.tries = failures, 0

    def write_json(self, path, obj):
        if path.endswith("/_resize.json"):
            self.tries += 1
            if self.tries <= self.failures:
                raise PermissionError(13, "the store refused the write", path)
        super().write_json(path, obj)


def test_growing_survives_failed_writes_of_the_resize_marker(tmp_path, caplog):
    """A failed write of the marker is tried again at the next poll (one warning per distinct error,
    not one per poll): training grows once the store takes it."""
    store = Store(str(tmp_path))
    store.files = files = _MarkerWritesFail(str(tmp_path), failures=3)
    backend = InProcessBackend(3)
    backend.slots = 2  # the first attempt has 2 ranks; a slot returns in epoch 2
    writer = ElasticWriter(backend, {2: "return"})
    with caplog.at_level("WARNING", logger="hvd_spark"):
        trained = _run(store, backend, writer, 4, min_num_proc=2, max_num_proc=3)
    assert writer.sizes == [2, 3] and files.tries == 4  # three failed writes, then the one that worked
    assert [(r.kind, r.from_size, r.to_size) for r in trained.recoveries] == [("grow", 2, 3)]
    warned = [r.getMessage() for r in caplog.records if "resize marker" in r.getMessage()]
    assert len(warned) == 1 and "the store refused the write" in warned[0], warned
