"""TorchEstimator's callbacks, ``fit_on_parquet``, and the faults a torch fit meets as a Keras one does: a
callback stopping the fit (on one rank), data changed between two fits of a run, the Spark job cancelled
mid-fit. Real Spark
``local[2]``, real ranks over Gloo, real Parquet and checkpoints. (A store outage: ``test_s3.py``; Spark
Connect: ``test_connect.py``.)"""

import json
import os
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import cancel_after_first_checkpoint, rank_processes  # noqa: E402
from _torch_helpers import data, torch_estimator, write  # noqa: E402

from hvd_spark import JobCancelledError, Store  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Recorder:
    """Writes every hook call of its rank to ``<folder>/rank-<r>.jsonl``; rank ``stop_rank`` sets
    ``stop_training`` after epoch ``stop_after`` (0-based)."""

    def __init__(self, folder: str, stop_rank: int, stop_after: int):
        self.folder, self.stop_rank, self.stop_after = folder, stop_rank, stop_after

    def _log(self, state, *event) -> None:
        with open(os.path.join(self.folder, f"rank-{state.rank}.jsonl"), "a") as f:
            f.write(json.dumps(list(event)) + "\n")

    def on_train_begin(self, state):
        self._log(state, "train_begin", state.size)

    def on_epoch_begin(self, epoch, state):
        self._log(state, "epoch_begin", epoch)

    def on_batch_end(self, step, logs, state):
        self._log(state, "batch_end", step, sorted(logs))

    def on_epoch_end(self, epoch, logs, state):
        self._log(state, "epoch_end", epoch, sorted(logs))
        if state.rank == self.stop_rank and epoch == self.stop_after:
            state.stop_training = True

    def on_train_end(self, state):
        self._log(state, "train_end")


def test_callbacks_run_on_every_rank_and_a_stop_on_one_rank_ends_the_fit_for_good(spark, tmp_path):
    """Rank 1 alone stops after epoch 2 of 5: both ranks stop there, the history has 2 epochs, the stop is
    in the checkpoint, and a later fit of the run (6 epochs) trains no more. Every hook ran on both ranks,
    in order, with one ``on_batch_end`` per step."""
    x, y = data()
    path = write(tmp_path, x, y)
    folder = tmp_path / "events"
    folder.mkdir()
    est = torch_estimator(tmp_path / "store", epochs=5, run_id="stops", callbacks=[Recorder(str(folder), 1, 1)])
    model = est.fit(spark.read.parquet(path))
    assert len(model.getHistory()["loss"]) == 2
    steps = model.getFitSummary().steps_per_epoch
    for rank in (0, 1):
        events = [json.loads(line) for line in (folder / f"rank-{rank}.jsonl").read_text().splitlines()]
        want = [["train_begin", 2]]
        for epoch in (0, 1):
            want += [["epoch_begin", epoch]] + [["batch_end", s, ["loss"]] for s in range(steps)]
            want += [["epoch_end", epoch, ["loss", "val_loss"]]]
        assert events == want + [["train_end"]], rank
    (last,) = Store(str(tmp_path / "store")).checkpoints("stops")[-1:]
    meta = json.loads(open(last.meta_path).read())
    assert meta["stopped"] == {"epoch": 2, "epochs": 5, "by": "a callback on another rank than 0"}
    again = est.copy({est.epochs: 6, est.callbacks: None}).fit(spark.read.parquet(path))
    assert len(again.getHistory()["loss"]) == 2 and again.getModelUrl() == model.getModelUrl()


def test_bad_callbacks_are_refused_before_any_work(tmp_path):
    import keras

    for bad in (["not a callback"], [keras.callbacks.EarlyStopping()]):
        with pytest.raises(TypeError, match="callbacks must be a list of hvd_spark.torch.Callback"):
            torch_estimator(tmp_path / "store", callbacks=bad)


def test_a_run_goes_on_only_with_its_own_data(spark, tmp_path):
    """A torch run resumes on its table and refuses the table rewritten with other rows, writing nothing."""
    x, y = data()
    path = write(tmp_path / "t", x, y)
    est = torch_estimator(tmp_path / "store", epochs=1, run_id="own")
    est.fit(spark.read.parquet(path))
    resumed = est.copy({est.epochs: 2}).fit(spark.read.parquet(path))
    assert len(resumed.getHistory()["loss"]) == 2
    x2, y2 = data(seed=1)
    write(tmp_path / "t", x2, y2)  # the same file, other values
    before = sorted(str(p) for p in (tmp_path / "store").rglob("*"))
    with pytest.raises(ValueError, match=r"run_id 'own' in .* was trained on other data"):
        est.copy({est.epochs: 3}).fit(spark.read.parquet(path))
    assert sorted(str(p) for p in (tmp_path / "store").rglob("*")) == before


def test_a_cancelled_torch_fit_returns_after_its_ranks_stopped_and_resumes_exactly(spark, tmp_path):
    """cancelAllJobs() during a long torch fit: fit raises JobCancelledError naming TorchEstimator.fit once
    its ranks have stopped (no process writes after it), and a fit of the run resumes with the epochs
    counted exactly."""
    x, y = data(rows=2000)
    path = write(tmp_path, x, y, rows=2000)
    store = Store(str(tmp_path / "store"))
    est = torch_estimator(tmp_path / "store", epochs=400, run_id="cancel", validation=None)
    errors = cancel_after_first_checkpoint(spark, lambda: est.fit(spark.read.parquet(path)), store, "cancel")
    assert errors and isinstance(errors[0], JobCancelledError), errors
    assert str(errors[0]).splitlines()[0].startswith("the Spark job of TorchEstimator.fit was cancelled")
    assert rank_processes() == []
    asked = store.checkpoints("cancel")[-1].epoch + 1
    model = est.copy({est.epochs: asked}).fit(spark.read.parquet(path))
    assert len(model.getHistory()["loss"]) == asked
    assert [c.epoch for c in store.checkpoints("cancel")] == list(range(1, asked + 1))
    summary = model.getFitSummary()
    np.testing.assert_array_equal([r.iterations for r in summary.ranks], [asked * summary.steps_per_epoch] * 2)


def test_fit_on_parquet_trains_a_torch_model_on_files_as_fit_does(spark, tmp_path):
    """``fit_on_parquet`` (files read in place, with no DataFrame; the inputs' lengths from the first file's
    first row) trains the same weights as ``fit(spark.read.parquet(path))``."""
    x, y = data()
    path = write(tmp_path / "t", x, y)
    by_fit = torch_estimator(tmp_path / "s1", epochs=2).fit(spark.read.parquet(path))
    by_files = torch_estimator(tmp_path / "s2", epochs=2).fit_on_parquet(str(tmp_path / "t"))
    assert by_files.getHistory() == by_fit.getHistory()
    want = by_fit.getModel().state_dict()
    for name, value in by_files.getModel().state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)
