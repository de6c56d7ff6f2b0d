"""hvd_spark.run on real Spark (local[2]) with real Horovod processes over Gloo."""

import logging
import os
import sys
import time

import cloudpickle
import pytest
from _helpers import horovod_mpi_built

import hvd_spark
from hvd_spark import JobDeadlineError, JobTimeoutError, RankFailedError
from hvd_spark._internal.common.logs import is_tf_notice

# The functions below run in the ranks' processes, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def collectives():
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    r = hvd.rank()
    summed = hvd.allreduce(tf.constant([r + 1.0, 10.0 * (r + 1)]), op=hvd.Sum).numpy()
    averaged = hvd.allreduce(tf.constant([float(r)]), op=hvd.Average).numpy()
    gathered = hvd.allgather(tf.constant([[r, r * r]], dtype=tf.int32)).numpy()
    from_root = hvd.broadcast(tf.constant([r * 7.0 + 3.0]), root_rank=0).numpy()
    big = hvd.allreduce(tf.fill([1 << 18], float(r + 1)), op=hvd.Sum).numpy()
    return {
        "rank": r,
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "summed": summed.tolist(),
        "averaged": averaged.tolist(),
        "gathered": gathered.tolist(),
        "from_root": from_root.tolist(),
        "big_ok": bool(np.all(big == 3.0)),
        "pid": os.getpid(),
        "threads": os.environ.get("TF_NUM_INTRAOP_THREADS"),
    }


def test_collectives_exact_values_ordered_by_rank(spark):
    results = hvd_spark.run(collectives, num_proc=2, spark=spark)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2 and r["local_size"] == 2 and r["local_rank"] == r["rank"]
        assert r["summed"] == [3.0, 30.0]
        assert r["averaged"] == [0.5]
        assert r["gathered"] == [[0, 0], [1, 1]]
        assert r["from_root"] == [3.0]
        assert r["big_ok"]
        assert r["threads"] == "1"
    assert results[0]["pid"] != results[1]["pid"]


def rank_output():
    import horovod.tensorflow as hvd

    hvd.init()
    print(f"hello from the child of rank {hvd.rank()}", flush=True)
    return hvd.rank()


def test_output_reaches_driver_log_with_rank_prefix(spark, caplog):
    with caplog.at_level(logging.INFO, logger="hvd_spark.rank"):
        assert hvd_spark.run(rank_output, num_proc=2, spark=spark, verbose=0) == [0, 1]
    lines = [r.getMessage() for r in caplog.records if r.name == "hvd_spark.rank"]
    assert "[rank 0] hello from the child of rank 0" in lines
    assert "[rank 1] hello from the child of rank 1" in lines
    # TF's C++ notices (oneDNN, CPU features, absl's pre-setup warning) stay out of the driver's log.
    assert not [line for line in lines if is_tf_notice(line.split("] ", 1)[1])], lines


def test_the_users_tf_log_level_wins(spark, caplog):
    """TF_CPP_MIN_LOG_LEVEL=0 asks for TF's INFO lines: then its notices reach the driver's log.
    (A fresh rank: a warm one never imports TF, its server did, and that server's log has them.)"""
    with caplog.at_level(logging.INFO, logger="hvd_spark.rank"):
        hvd_spark.run(rank_output, num_proc=1, spark=spark, verbose=0, env={"TF_CPP_MIN_LOG_LEVEL": "0"}, warm=False)
    lines = [r.getMessage().split("] ", 1)[1] for r in caplog.records if r.name == "hvd_spark.rank"]
    assert any(is_tf_notice(line) for line in lines), lines


def args_and_kwargs(a, b, *, scale):
    import horovod.tensorflow as hvd

    hvd.init()
    return (a + b) * scale + hvd.rank()


def test_args_kwargs_and_default_num_proc(spark):
    # num_proc defaults to the task slots of local[2].
    assert hvd_spark.run(args_and_kwargs, args=(1, 2), kwargs={"scale": 10}, spark=spark) == [30, 31]


def fail_on_rank_one(pid_dir):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    with open(os.path.join(pid_dir, f"pid-{hvd.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if hvd.rank() == 1:
        raise ValueError("rank one cannot go on: bad shard")
    # Rank 0 waits in a collective that rank 1 never joins, then sleeps: only the abort ends it.
    try:
        hvd.allreduce(tf.constant([1.0]))
    except Exception:
        pass
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(240)  # bounded: the failure surfaces long before rank 0's 600 s sleep ends
def test_failing_rank_is_reported_and_others_stopped(spark, tmp_path):
    with pytest.raises(
        RankFailedError, match="rank 1 on host 127.0.0.1 failed with ValueError: rank one cannot go on"
    ) as info:
        hvd_spark.run(fail_on_rank_one, args=(str(tmp_path),), num_proc=2, spark=spark)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError" and err.host == "127.0.0.1"
    assert "fail_on_rank_one" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)
    pids = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a rank process survived the failed job"
    # Spark is usable afterwards: the next job runs.
    assert hvd_spark.run(rank_output, num_proc=2, spark=spark, verbose=0) == [0, 1]


def crash_rank_zero():
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 0:
        os._exit(3)
    time.sleep(600)


@pytest.mark.timeout(240)
def test_rank_process_dying_without_exception(spark):
    with pytest.raises(
        RankFailedError, match="rank 0 on host 127.0.0.1 failed with ProcessDied: process exited with code 3"
    ):
        hvd_spark.run(crash_rank_zero, num_proc=2, spark=spark)


def stall_rank_one(attempts=None):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    if attempts and hvd.rank() == 0:
        with open(attempts, "a") as f:
            f.write("attempt\n")
    if hvd.rank() == 1:
        time.sleep(600)  # never joins the collective
    return hvd.allreduce(tf.constant([1.0])).numpy().tolist()


@pytest.mark.timeout(240)
def test_stalled_collective_is_reported_by_rank(spark, tmp_path):
    attempts = tmp_path / "attempts"
    with pytest.raises(JobDeadlineError, match=r"ranks \[0, 1\] had not finished") as info:
        hvd_spark.run(stall_rank_one, args=(str(attempts),), num_proc=2, spark=spark, timeout=40, max_restarts=2)
    assert attempts.read_text().splitlines() == ["attempt"]  # the whole job's time is spent: no restart
    assert isinstance(info.value, JobTimeoutError) and info.value.ranks == [0, 1]
    where = {int(line.split()[1]): line for line in str(info.value).splitlines() if line.startswith("  rank ")}
    # Rank 0 waits inside Horovod's allreduce; rank 1 never left its own code (the sleep).
    assert "allreduce" in where[0] and "stall_rank_one" in where[0]
    assert "stall_rank_one" in where[1] and "allreduce" not in where[1]


@pytest.mark.timeout(60)  # Spark alone would retry barrier scheduling for about 10 minutes
def test_too_many_processes_fails_fast(spark):
    with pytest.raises(
        ValueError,
        match=r"num_proc must be at most the number of task slots \(2\) for a barrier stage\. "
        r"Received: num_proc=3",
    ):
        hvd_spark.run(rank_output, num_proc=3, spark=spark)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_num_proc(spark, bad):
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        hvd_spark.run(rank_output, num_proc=bad, spark=spark)


def test_bad_arguments(spark):
    with pytest.raises(TypeError, match="fn must be callable"):
        hvd_spark.run("not a function", num_proc=1, spark=spark)
    with pytest.raises(ValueError, match="not both"):
        hvd_spark.run(rank_output, num_proc=1, spark=spark, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="start_timeout must be greater than 0"):
        hvd_spark.run(rank_output, num_proc=1, spark=spark, start_timeout=0)


@pytest.mark.mpi
@pytest.mark.skipif(not horovod_mpi_built(), reason="Horovod built without MPI (no OpenMPI on this machine)")
def test_mpi_controller_allreduce(spark):
    results = hvd_spark.run(collectives, num_proc=2, spark=spark, use_mpi=True)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["summed"] == [3.0, 30.0] and r["gathered"] == [[0, 0], [1, 1]] for r in results)


@pytest.mark.mpi
@pytest.mark.skipif(not horovod_mpi_built(), reason="Horovod built without MPI (no OpenMPI on this machine)")
def test_mpi_controller_failure(spark, tmp_path):
    with pytest.raises(RankFailedError, match="rank 1 on host 127.0.0.1 failed with ValueError"):
        hvd_spark.run(fail_on_rank_one, args=(str(tmp_path),), num_proc=2, spark=spark, use_mpi=True)


def test_use_gpu_without_gpus_scheduled_names_the_conf_keys_before_any_work(spark):
    with pytest.raises(ValueError, match=r"use_gpu=True needs GPUs scheduled to the barrier tasks") as e:
        hvd_spark.run(rank_output, num_proc=1, spark=spark, use_gpu=True)
    assert "spark.task.resource.gpu.amount" in str(e.value) and "spark.executor.resource.gpu.amount" in str(e.value)
    with pytest.raises(TypeError, match=r"use_gpu must be True, False or None\. Received: use_gpu='yes'"):
        hvd_spark.run(rank_output, num_proc=1, spark=spark, use_gpu="yes")


def committing_job(marker: str):
    """Ten allreduce steps, each committed; rank 1 kills itself after step 5 of the first attempt."""
    import signal

    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_spark

    hvd.init()
    state = hvd_spark.committed_state({"step": 0, "total": 0.0})
    start, total = state["step"], state["total"]
    for step in range(start, 10):
        total += float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()[0])
        hvd_spark.commit_state({"step": step + 1, "total": total})
        if step == 4 and hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return {"start": start, "total": total, "size": hvd.size()}


def test_a_restarted_job_continues_from_rank_0s_last_commit(spark, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="hvd_spark")
    marker = str(tmp_path / "killed")
    out = hvd_spark.run(
        committing_job, args=(marker,), min_num_proc=1, max_num_proc=2, max_restarts=1, verbose=0, stall_timeout=60
    )
    assert os.path.exists(marker)  # the first attempt lost rank 1
    # the second attempt started at rank 0's last commit (after 5 steps), not at 0, and made the other 5
    assert [r["start"] for r in out] == [5, 5] and [r["total"] for r in out] == [20.0, 20.0]
    assert [r["size"] for r in out] == [2, 2]
    assert any("restarting (1 of max_restarts=1) on 2 ranks from commit" in r.getMessage() for r in caplog.records)


def test_elastic_run_arguments_are_checked_before_any_work(spark):
    with pytest.raises(ValueError, match="max_restarts >= 1"):
        hvd_spark.run(collectives, min_num_proc=1)
    with pytest.raises(ValueError, match="min_num_proc must be at most max_num_proc"):
        hvd_spark.run(collectives, min_num_proc=3, max_num_proc=2, max_restarts=1)
    with pytest.raises(ValueError, match="elastic_timeout applies to elastic jobs only"):
        hvd_spark.run(collectives, elastic_timeout=5)
    # local[2] has two slots for good: waiting elastic_timeout for a third would be pointless
    with pytest.raises(ValueError, match=r"min_num_proc=3 is more than the 2 task slots of this local master"):
        hvd_spark.run(collectives, min_num_proc=3, max_restarts=1)


def sleeps_after_marking(marker):
    import pathlib

    pathlib.Path(f"{marker}-{os.environ.get('HVD_SPARK_RANK', '?')}").touch()
    time.sleep(300)
    return "slept"


@pytest.mark.parametrize("mark", ["group", "tag"])
def test_cancelling_the_users_job_group_or_tag_stops_a_run(spark, tmp_path, mark):
    """A run started on a thread under the user's job group (or job tag) stops when the user cancels that
    group (tag): the barrier stage keeps the caller's group and tags and adds its own tag (issue 47.5:
    the stage replaced the user's group, so cancelJobGroup missed the training). The caller's group is
    its own again after the run."""
    import threading

    from _helpers import rank_processes

    from hvd_spark import JobCancelledError

    sc = spark.sparkContext
    name = f"users-{mark}-{tmp_path.name}"
    outcome: list = []
    seen: dict = {}

    def users_thread():
        if mark == "group":
            sc.setJobGroup(name, "the user's work", interruptOnCancel=False)
        else:
            sc.addJobTag(name)
        try:
            outcome.append(hvd_spark.run(sleeps_after_marking, args=(str(tmp_path / "started"),), num_proc=2))
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)
        seen["group"], seen["tags"] = sc.getLocalProperty("spark.jobGroup.id"), set(sc.getJobTags())

    thread = threading.Thread(target=users_thread)  # a plain thread: pinned to a JVM thread of its own
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("started-*"))) < 2:
            assert thread.is_alive() and time.monotonic() < deadline, f"the ranks did not start in 240 s: {outcome}"
            time.sleep(0.2)
        t_cancel = time.monotonic()
        sc.cancelJobGroup(name) if mark == "group" else sc.cancelJobsWithTag(name)
        thread.join(90)
        stopped = time.monotonic() - t_cancel
        assert not thread.is_alive(), f"the run went on 90 s after the user's job {mark} was cancelled"
    finally:
        if thread.is_alive():  # (the old behaviour) stop it for the tests after this one
            sc.cancelAllJobs()
            thread.join(120)
    print(f"the run raised {stopped:.1f} s after the user's job {mark} was cancelled")
    assert len(outcome) == 1 and isinstance(outcome[0], JobCancelledError), outcome
    assert str(outcome[0]).splitlines()[0].startswith("the Spark job of hvd_spark.run was cancelled")
    assert rank_processes() == []
    assert seen == ({"group": name, "tags": set()} if mark == "group" else {"group": None, "tags": {name}})
