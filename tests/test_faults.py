"""Faults that break things for real: a rank that stalls (SIGSTOP of its process, a
collective that one rank never joins) is found by the stall watchdog, reported with its host and
where each rank was, and then restarted from the last checkpoint or failed; crash points: a rank
dying between a checkpoint's model file and its JSON, and the driver killed (kill -9) mid-fit (the
next fit takes its run over at once: its process is gone); a store too small for the data's copy
(a 2 MB tmpfs) and a user's UDF failing in the copy, whose errors' first lines name what hvd_spark
was doing and the root cause."""

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import keras
import psutil
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
    # Shown with -s: the time from the SIGSTOP to the watchdog's report.
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


class CrashBeforeCheckpointJson(keras.callbacks.Callback):
    """Rank 0's process dies (os._exit) between the model file of epoch 3's checkpoint and its JSON,
    the first time only: the crash point where a checkpoint is half written."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 2 or os.environ.get("HVD_SPARK_RANK") != "0" or os.path.exists(self.marker):
            return
        from hvd_spark._internal.data.files import StoreFiles as S

        original, marker = S.write_json, self.marker

        def crash_before_json(self, path, obj):
            if path.endswith("checkpoints/epoch-0003.json"):
                assert os.path.exists(path[: -len(".json")] + ".keras")  # the model file is there
                open(marker, "w").close()
                os._exit(7)
            return original(self, path, obj)

        S.write_json = crash_before_json


def test_a_crash_between_a_checkpoints_model_file_and_its_json_resumes_from_the_previous(spark, tmp_path, caplog):
    df = xor_frame(spark, 128)
    store = str(tmp_path / "store")
    est = xor_estimator(
        store, epochs=4, run_id="half", callbacks=[CrashBeforeCheckpointJson(str(tmp_path / "crashed"))]
    )
    est.setParams(max_restarts=1, verbose=0)
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = est.fit(df)
    assert os.path.exists(tmp_path / "crashed")  # the crash happened
    assert "resuming run 'half' from epoch 2 of 4" in caplog.text  # not from the half-written epoch 3
    summary = model.getFitSummary()
    assert summary.restarts == 1 and len(model.getHistory()["loss"]) == 4
    assert [c.epoch for c in Store(store).checkpoints("half")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * summary.steps_per_epoch


_DRIVER = """
import sys
sys.path.insert(0, {tests!r})
import hvd_spark
from _helpers import xor_estimator, xor_frame

spark = hvd_spark.local_session("local[2]", app_name="driver-to-kill")
spark.sparkContext.setLogLevel("ERROR")
xor_estimator({store!r}, epochs=500, run_id={run_id!r}, verbose=0).fit(xor_frame(spark, 2048))
"""


def _job_processes(root: int) -> dict[int, str]:
    """The driver's process tree, and the rank processes and warm servers anywhere (pid -> command)."""
    from hvd_spark._internal.task.barrier import RANK_NAME

    found = {}
    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                found[p.pid] = " ".join(p.cmdline())[:160]
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "hvd_spark._internal" in cmd or p.info["name"] == RANK_NAME:
            found[p.pid] = cmd[:160] or p.info["name"]
    return found


def _driver_stopped_mid_fit(store: str, run_id: str, script, sig: int) -> tuple[subprocess.Popen, int, float]:
    """A driver process fitting ``run_id`` on ``local[2]``, sent ``sig`` once it wrote 2 checkpoints; returns
    once it and every process of its job ended: the driver, how many of those there were, and the seconds
    from the signal to the driver's exit."""
    before = set(_job_processes(os.getpid()))
    script.write_text(_DRIVER.format(tests=os.path.dirname(__file__), store=store, run_id=run_id))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(Store(store).checkpoints(run_id)) < 2:
            assert driver.poll() is None, "the driver ended before it was signalled"
            assert time.monotonic() < deadline, "the fit made no checkpoint in 300 s"
            time.sleep(0.5)
        job = {pid: cmd for pid, cmd in _job_processes(driver.pid).items() if pid not in before}
        assert any("hvd_spark._internal" in cmd or "rank" in cmd for cmd in job.values())  # ranks were running
        t_signal = time.monotonic()
        driver.send_signal(sig)
        driver.wait(timeout=120)
        exited = time.monotonic() - t_signal
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in job):
            if time.monotonic() - t_signal > 120:
                break
            time.sleep(0.5)
        left = {pid: cmd for pid, cmd in job.items() if psutil.pid_exists(pid)}
        left = {pid: cmd for pid, cmd in left.items() if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
        assert not left, f"processes of the stopped driver's job still alive 120 s after {sig!r}: {left}"
        print(
            f"{sig!r}: the driver exited {exited:.1f} s after it, all {len(job)} processes of its job gone "
            f"{time.monotonic() - t_signal:.1f} s after it"
        )
        return driver, len(job), exited
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_driver_killed_mid_fit_leaves_no_process_and_its_run_resumes(spark, tmp_path, caplog):
    store = str(tmp_path / "store")
    driver, _, _ = _driver_stopped_mid_fit(store, "killed", tmp_path / "driver.py", signal.SIGKILL)
    # The killed driver's lease on the run is still fresh, but its process is gone from this host: the
    # next fit takes the run over at once (issue 47.4; it was refused until the lease's 60 s expired)
    # and resumes where the killed fit left it.
    done = len(Store(store).checkpoints("killed"))
    lease = json.load(open(os.path.join(store, "runs", "killed", "_writer.json")))
    assert lease["pid"] == driver.pid and time.time() - float(lease["heartbeat"]) < 60
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = xor_estimator(store, epochs=done + 1, run_id="killed", verbose=0).fit(xor_frame(spark, 2048))
    assert f"(pid {driver.pid}): its process is gone from this host" in caplog.text
    assert f"resuming run 'killed' from epoch {done} of {done + 1}" in caplog.text
    assert len(model.getHistory()["loss"]) == done + 1
    assert [c.epoch for c in Store(store).checkpoints("killed")] == list(range(1, done + 2))


def test_a_driver_stopped_with_sigterm_cleans_up_and_the_next_fit_takes_the_run_over_at_once(spark, tmp_path, caplog):
    """SIGTERM (what YARN, Kubernetes and spot reclaims send first) ends the fit as a cancel does: its ranks
    stop, its leases (the run's, the data's reading lease) are released and its temporary data removed
    before the process exits with SIGTERM's status (issue 47.4: it left its lease, and the next driver was
    refused 22 times over 60.8 s)."""
    store = str(tmp_path / "store")
    driver, _, _ = _driver_stopped_mid_fit(store, "termed", tmp_path / "driver.py", signal.SIGTERM)
    assert driver.returncode == -signal.SIGTERM  # the usual status (a shell's 143)
    leases = [
        os.path.relpath(os.path.join(root, name), store)
        for root, _, names in os.walk(store)
        for name in names
        if name.startswith(("_writer", "_reading-", "_writing-"))
    ]
    assert leases == [], f"leases left by the driver stopped with SIGTERM: {leases}"
    done = len(Store(store).checkpoints("termed"))
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = xor_estimator(store, epochs=done + 1, run_id="termed", verbose=0).fit(xor_frame(spark, 2048))
    print(f"the next fit of the run took it over at once and finished in {time.monotonic() - t0:.1f} s")
    assert "taking over" not in caplog.text  # nothing was left to take over
    assert f"resuming run 'termed' from epoch {done} of {done + 1}" in caplog.text
    assert len(model.getHistory()["loss"]) == done + 1


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs: a store on it runs out of space while the data is copied."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a 2 MB tmpfs store needs `mount -t tmpfs` (root): {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("writer", ["spark", "store"])  # Spark's Parquet writer; each task through fsspec
def test_a_full_disk_while_the_data_is_copied_names_the_store_and_the_cause_and_leaves_no_attempt(
    spark, small_disk, writer
):
    from pyspark.sql import functions as F

    # About 4 MB of random floats: twice the disk. The run's lease (a few hundred bytes) is written
    # before; the data is the first large write.
    df = spark.range(500_000).select(
        F.array(F.rand(1).cast("float"), F.rand(2).cast("float")).alias("x"), (F.rand(3) > 0.5).cast("long").alias("y")
    )
    store = str(small_disk / "store")
    with pytest.raises(Exception) as info:
        xor_estimator(Store(store, parquet_writer=writer), run_id="full", verbose=0).fit(df)
    first = str(info.value).splitlines()[0]
    assert "writing the training data to" in first and store in first, f"{type(info.value).__name__}: {first}"
    assert "No space left on device" in first, first
    assert isinstance(info.value, hvd_spark.DataPreparationError)
    assert info.value.__cause__ is not None  # Spark's own error, for its stack traces
    data = small_disk / "store" / "data"
    left = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs] if data.exists() else []
    assert left == [] and (not data.exists() or os.listdir(data) == []), left  # no half-written attempt


@pytest.mark.parametrize("writer", ["spark", "store"])
def test_a_users_udf_failing_while_the_data_is_copied_is_named_in_the_first_line(spark, tmp_path, writer):
    from pyspark.sql import functions as F

    @F.udf("long")
    def label_of(v):
        if v == 7:
            raise ArithmeticError(f"no label for row {v}")
        return v % 2

    df = xor_frame(spark, 64).withColumn("id", F.monotonically_increasing_id()).withColumn("y", label_of("id"))
    store = str(tmp_path / "store")
    with pytest.raises(Exception) as info:
        xor_estimator(Store(store, parquet_writer=writer), run_id="udf", verbose=0).fit(df)
    first = str(info.value).splitlines()[0]
    assert "writing the training data to" in first and store in first, f"{type(info.value).__name__}: {first}"
    assert "ArithmeticError: no label for row 7" in first and "label_of" in first, first
    assert isinstance(info.value, hvd_spark.DataPreparationError)
