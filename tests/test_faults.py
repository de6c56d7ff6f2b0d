"""Faults that break things for real (issue 14): a rank that stalls (SIGSTOP of its process, a
collective that one rank never joins) is found by the stall watchdog, reported with its host and
where each rank was, and then restarted from the last checkpoint or failed."""

import logging
import os
import sys
import time

import keras
import pytest
from _helpers import xor_estimator, xor_frame

import hvd_spark
from hvd_spark import RankStalledError, Store


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class StopRankOnce(keras.callbacks.Callback):
    """Rank 1 stops its own process (SIGSTOP: it stays alive and silent) at the end of epoch 2, once.
    The marker file records when."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_epoch_end(self, epoch, logs=None):
        import signal

        if epoch == 1 and os.environ.get("HVD_SPARK_RANK") == "1" and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def test_a_stopped_rank_is_found_by_the_stall_watchdog_and_the_fit_restarts(spark, tmp_path, caplog):
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    marker = str(tmp_path / "stopped")
    est = xor_estimator(
        store, epochs=4, run_id="stally", callbacks=[StopRankOnce(marker)], max_restarts=1, stall_timeout=8
    )
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = est.fit(df)
    stopped_at = float(open(marker).read())
    summary = model.getFitSummary()
    assert summary.restarts == 1
    assert len(model.getHistory()["loss"]) == 4  # every epoch exactly once
    assert [c.epoch for c in Store(store).checkpoints("stally")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch
    stall = next(r for r in caplog.records if r.getMessage().startswith("stalled: no rank made progress"))
    assert "stall_timeout=8s" in stall.getMessage()
    restart = next(r for r in caplog.records if "restarting (1 of max_restarts=1)" in r.getMessage())
    assert "rank(s) [1]" in restart.getMessage() and "process stopped" in restart.getMessage()
    # For the note: the time from the SIGSTOP to the watchdog's report.
    print(f"stall detected {stall.created - stopped_at:.1f} s after the SIGSTOP (stall_timeout=8)")


def never_joins():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    for i in range(100000):
        hvd_spark.mark_progress(f"iteration {i}")
        if hvd.rank() == 1 and i == 3:
            time.sleep(3600)  # rank 1 never joins the next allreduce
        hvd.allreduce(tf.constant(1.0))
    return i


def test_a_collective_one_rank_never_joins_is_a_stall(spark):
    with pytest.raises(RankStalledError) as caught:
        hvd_spark.run(never_joins, num_proc=2, spark=spark, verbose=0, stall_timeout=6, timeout=300)
    err = caught.value
    text = str(err)
    assert err.ranks[0] == 1  # the rank outside the collective is named first
    assert sorted(err.ranks) == [0, 1] and set(err.hosts) == {0, 1}
    assert "Most likely stalled: rank(s) [1]" in text
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if line.startswith("  rank ")}
    assert "in never_joins" in lines["rank 1 (process sleeping)"]
    assert "in allreduce" in lines["rank 0 (process sleeping)"]
    assert "last at iteration 3" in text


def test_without_a_stall_timeout_a_function_that_never_ticks_finishes(spark):
    def quiet():
        time.sleep(8)  # longer than the smallest stall_timeout, and no mark_progress
        return 1

    assert hvd_spark.run(quiet, num_proc=2, spark=spark, verbose=0) == [1, 1]
