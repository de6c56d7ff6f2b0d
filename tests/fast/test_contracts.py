"""The restart policy and the fit summary records: pure functions and dataclasses."""

import dataclasses

import pytest

from hvd_spark._internal.contracts import FitSummary, RankSummary
from hvd_spark._internal.restarts import should_restart
from hvd_spark.errors import HvdSparkError, JobTimeoutError, LaunchError, RankFailedError


def _rank_failed():
    return RankFailedError(1, "ProcessDied", "killed by signal 9")


@pytest.mark.parametrize("error", [_rank_failed(), LaunchError("tasks did not start"), JobTimeoutError("late")])
def test_job_failures_restart_until_the_limit(error):
    assert should_restart(error, 0, 2) and should_restart(error, 1, 2)
    assert not should_restart(error, 2, 2)
    assert not should_restart(error, 0, 0)  # max_restarts=0: never


@pytest.mark.parametrize("error", [ValueError("bad input"), HvdSparkError("weights differ"), KeyboardInterrupt()])
def test_other_errors_never_restart(error):
    assert not should_restart(error, 0, 5)


def test_rank_summary_from_a_rank_result_and_frozen_records():
    r = RankSummary.from_result({"rank": 1, "weights_digest": "ab", "iterations": 40, "extra": "ignored"})
    assert (r.rank, r.weights_digest, r.iterations, r.train_seconds) == (1, "ab", 40, None)
    s = FitSummary("run", "key", 20, 0, 1.0, 9.0, 12.0, (r,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.restarts = 3  # type: ignore[misc]


def test_run_config_pickles_and_changes_per_attempt():
    import pickle

    from hvd_spark._internal.contracts import DataSpec, RunConfig
    from hvd_spark._internal.specs import ColumnInfo, TensorSpec

    data = DataSpec(
        (ColumnInfo("x", "array", "float", False, stored="c0"),),
        (ColumnInfo("y", "scalar", "int", True, stored="c1"),),
        None,
        (TensorSpec("x", (4,), "float32"),),
        (TensorSpec("y", (1,), "float32"),),
    )
    base = RunConfig(
        store={"prefix": "/s", "storage_options": {}},
        run_id="r",
        epochs=3,
        compile={},
        custom_objects=None,
        callbacks=None,
        data=data,
        train_files=[["a"], ["b"]],
        val_files=None,
        batch_size=8,
        val_batch_size=8,
        steps_per_epoch=5,
        validation_steps=None,
        shuffle=True,
        shuffle_buffer_size=100,
        seed=1,
        verbose=1,
        reader="arrow",
        num_threads=1,
        model_bytes=b"model",
    )
    second = dataclasses.replace(base, initial_epoch=2, resume_ckpt="/s/ckpt", model_bytes=None)
    assert pickle.loads(pickle.dumps(second)) == second and base.initial_epoch == 0
    kw = data.reader_kwargs()
    assert kw["features"][0].stored == "c0" and kw["weight"] is None and kw["inputs"][0].dims == (4,)
