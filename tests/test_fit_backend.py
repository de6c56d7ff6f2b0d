"""``fit`` through the estimator's ``backend`` seam: an object of horovod.spark's Backend shape runs the
ranks (here played in the driver by ``InProcessBackend``, with a rank function that writes what
``rank/train.py`` writes), while the checks, the data's materialization, the run's planning and the
returned model are the real ones. A backend object is kept beside the Params and never saved."""

import math

import numpy as np
import pytest
from _helpers import xor_estimator, xor_frame

from hvd_spark._internal.common.contracts import RunConfig
from hvd_spark._internal.data.store import Store, checkpoint_names
from hvd_spark._internal.ml.backend import InProcessBackend, in_process_rank


class CopyingRank:
    """Rank 0 "trains" by copying the model it starts from into each epoch's checkpoint and the final
    model, as ``rank/train.py`` lays them out; every rank reports the same weights. ``fail_once``: rank
    1 raises in that epoch of the first attempt."""

    def __init__(self, fail_once: int | None = None):
        self.fail_once = fail_once
        self.configs: list[RunConfig] = []

    def __call__(self, cfg: RunConfig) -> dict:
        me = in_process_rank()
        store = Store.from_config(cfg.store)
        if me.rank == 0:
            self.configs.append(cfg)
        start = (
            cfg.start.model_bytes if cfg.start.resume_ckpt is None else store.files.read_bytes(cfg.start.resume_ckpt)
        )
        history = [dict(h) for h in cfg.start.history_so_far]
        for epoch in range(cfg.start.initial_epoch + 1, cfg.epochs + 1):
            if self.fail_once == epoch:
                if me.rank == 1:
                    self.fail_once = None
                    raise OSError("the rank's disk is full")
                return {"rank": me.rank}  # its peer fails in this epoch: the allreduce never completes
            if me.rank == 0:
                history = history[: epoch - 1] + [{"loss": 1.0 / epoch}]
                model_name, meta_name = checkpoint_names(epoch)
                folder = store.checkpoints_path(cfg.run_id)
                store.files.write_bytes(f"{folder}/{model_name}", start)
                store.files.write_json(
                    f"{folder}/{meta_name}", {"epoch": epoch, "logs": history[-1], "history": history, "time": 0.0}
                )
        result = {"rank": me.rank, "weights_digest": "same", "iterations": cfg.epochs * cfg.shares.steps_per_epoch}
        if me.rank == 0:
            store.files.write_bytes(cfg.commits.final_model, start)
            result["epoch_logs"] = history
        return result


@pytest.fixture(scope="module")
def df(spark):
    return xor_frame(spark, 128).cache()


def test_fit_runs_its_ranks_through_the_backend_and_resumes(df, tmp_path):
    store = str(tmp_path / "store")
    rank = CopyingRank()
    backend = InProcessBackend(2, rank_fn=rank)
    est = xor_estimator(store, backend=backend, num_proc=None, run_id="seam", batch_size=16, epochs=2)
    assert est.getBackend() is backend and est.getOrDefault("backend") == "gloo"
    model = est.fit(df)
    cfg = rank.configs[0]
    assert len(cfg.shares.train_files) == 2 and cfg.start.model_bytes and cfg.start.initial_epoch == 0
    assert cfg.shares.steps_per_epoch == math.ceil(128 / (16 * 2))
    summary = model.getFitSummary()
    assert [r.rank for r in summary.ranks] == [0, 1] and summary.restarts == 0 and backend.calls == 1
    assert model.getHistory() == {"loss": [1.0, 0.5]}
    x = np.stack(df.limit(4).toPandas()["x"].tolist())
    assert model.getModel().predict(x, verbose=0).shape == (4, 1)  # the file the rank wrote is the model

    # the same run with more epochs continues from its checkpoint
    est.setEpochs(3)
    resumed = est.fit(df)
    cfg = rank.configs[-1]
    assert (cfg.start.initial_epoch, cfg.start.model_bytes) == (2, None) and cfg.start.resume_ckpt.endswith(
        "epoch-0002.keras"
    )
    assert resumed.getHistory() == {"loss": [1.0, 0.5, 1.0 / 3]}
    # and a run that has its epochs returns its model without a training job
    calls = backend.calls
    assert est.setEpochs(3).fit(df).getFitSummary() is None and backend.calls == calls


def test_a_failed_attempt_restarts_through_the_backend(df, tmp_path):
    rank = CopyingRank(fail_once=2)
    backend = InProcessBackend(2, rank_fn=rank)
    model = xor_estimator(tmp_path / "store", backend=backend, epochs=3, max_restarts=1, run_id="r").fit(df)
    assert model.getFitSummary().restarts == 1 and backend.calls == 2
    assert [c.start.initial_epoch for c in rank.configs] == [0, 1]
    assert model.getHistory() == {"loss": [1.0, 0.5, 1.0 / 3]}


def test_without_restarts_the_rank_failure_reaches_the_user(df, tmp_path):
    from hvd_spark import RankFailedError

    est = xor_estimator(tmp_path / "store", backend=InProcessBackend(2, rank_fn=CopyingRank(fail_once=1)))
    with pytest.raises(RankFailedError, match="rank 1 failed with OSError: the rank's disk is full"):
        est.fit(df)


def test_num_proc_must_agree_with_the_backend(df, tmp_path):
    est = xor_estimator(tmp_path / "store", backend=InProcessBackend(2, rank_fn=CopyingRank()), num_proc=1)
    with pytest.raises(ValueError, match=r"num_proc must be unset or equal to backend\.num_processes\(\) \(2\)"):
        est.fit(df)


def test_a_backend_object_is_kept_beside_the_params_and_never_saved(spark, tmp_path):
    backend = InProcessBackend(2, rank_fn=CopyingRank())
    est = xor_estimator(tmp_path / "store", backend=backend)
    assert est.copy().getBackend() is backend  # copies (tuning, fit(df, params)) share it
    with pytest.raises(TypeError, match=r"backend must be 'gloo', 'mpi' or an object with run"):
        est.set(est.backend, backend)  # a Param value cannot hold it
    path = str(tmp_path / "saved")
    est.save(path)
    loaded = type(est).load(path)
    assert loaded.getBackend() == "gloo"
    assert est.setBackend("mpi").getBackend() == "mpi"  # a controller's name replaces the object
    assert est.setBackend(backend).getOrDefault("backend") == "mpi" and est.getBackend() is backend


def test_a_wrong_param_fails_when_it_is_set():
    """Before any work: at the constructor and at setParams, naming the param."""
    from hvd_spark import HorovodEstimator

    for kw, match in [
        (dict(run_id=3), r'param "run_id"\. run_id must be a string or None'),
        (dict(use_gpu="yes"), r"use_gpu must be True, False or None"),
        (dict(start_timeout=[1]), r"start_timeout must be a number of seconds"),
        (dict(stall_timeout="1m"), r"stall_timeout must be a number of seconds"),
        (dict(mlflow=2), r"mlflow must be 'auto', 'on' or 'off'"),
        (dict(batch_size=2.5), r"batch_size must be an integer"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            HorovodEstimator(**kw)
        with pytest.raises((TypeError, ValueError), match=match):
            HorovodEstimator().setParams(**kw)
