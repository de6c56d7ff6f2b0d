"""The launcher's pieces that decide things before any Spark job: the launch options and their
checks (driver/options.py), the slot pool (driver/slots.py), the payload (driver/launcher.py) and
which stage errors are Spark's cancellation (driver/classic.py). No Spark: a session is a stand-in
that looks like Spark Connect to hvd_spark (a conf, nothing else)."""

import threading
import time

import pytest

from hvd_spark._internal.driver import options as options_module
from hvd_spark._internal.driver.options import resolve_backend, resolve_launch_options


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _ConnectSession:
    session_id = "fake"

    def __init__(self, master="local[4]", **conf):
        self.conf = _Conf({"spark.master": master, **conf})

    def range(self, *args):
        raise AssertionError("a local master's slots come from its URL")


_ConnectSession.__module__ = "pyspark.sql.connect.session"


@pytest.fixture
def no_mpi(monkeypatch):
    monkeypatch.setattr(options_module, "_mpi_available", lambda: False)


def test_the_backend_comes_from_one_of_its_spellings(no_mpi, monkeypatch):
    assert resolve_backend() == "gloo"
    assert resolve_backend(use_gloo=True) == "gloo"
    assert resolve_backend("gloo", use_gloo=True) == "gloo"
    with pytest.raises(ValueError, match=r"Choose one controller: use_gloo=True or use_mpi=True"):
        resolve_backend(use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match=r"backend='gloo' contradicts use_mpi=True"):
        resolve_backend("gloo", use_mpi=True)
    with pytest.raises(ValueError, match=r"backend must be 'gloo' or 'mpi'. Received: backend='nccl'"):
        resolve_backend("nccl")
    with pytest.raises(ValueError, match=r"needs Horovod built with MPI and mpirun on the PATH"):
        resolve_backend(use_mpi=True)
    monkeypatch.setattr(options_module, "_mpi_available", lambda: True)
    assert resolve_backend(use_mpi=True) == "mpi"


def test_options_of_a_local_master_come_from_its_url(no_mpi, monkeypatch):
    monkeypatch.delenv("HVD_SPARK_RANK_LAYOUT", raising=False)
    spark = _ConnectSession("local[4]", **{"spark.app.id": "app-7"})
    slot = resolve_launch_options(spark, num_proc=None, layout="slot")
    assert (slot.num_proc, slot.slots, slot.num_threads, slot.app, slot.master) == (4, 4, 1, "app-7", "local[4]")
    assert slot.backend == "gloo" and slot.use_gpu is False and slot.forks_warm
    host = resolve_launch_options(spark, num_proc=None, layout="host")
    assert (host.num_proc, host.num_threads) == (1, 4)  # one rank on all of the master's cores
    assert resolve_launch_options(spark, num_proc=2, layout="slot", num_threads=3).num_threads == 3
    assert resolve_launch_options(spark, num_proc=1).app == "app-7"


def test_the_slot_check_names_the_slots_and_spark_task_cpus(no_mpi):
    spark = _ConnectSession("local[4]", **{"spark.task.cpus": "2"})
    assert resolve_launch_options(spark, num_proc=2).slots == 2
    with pytest.raises(
        ValueError,
        match=r"num_proc must be at most the number of task slots \(2\) for a barrier stage. Received: num_proc=3. "
        r".*master=local\[4\], spark.task.cpus=2",
    ):
        resolve_launch_options(spark, num_proc=3)


@pytest.mark.parametrize("num_proc", [0, -1, True, 2.0, "2"])
def test_num_proc_must_be_a_positive_integer(num_proc):
    with pytest.raises(ValueError, match=r"num_proc must be a positive integer"):
        resolve_launch_options(_ConnectSession(), num_proc=num_proc)


def test_env_threads_and_use_gpu_are_checked(no_mpi):
    spark = _ConnectSession()
    with pytest.raises(TypeError, match=r"env must map str to str"):
        resolve_launch_options(spark, num_proc=1, env={"A": 1})
    with pytest.raises(ValueError, match=r"num_threads must be a positive integer. Received: num_threads=0"):
        resolve_launch_options(spark, num_proc=1, num_threads=0)
    with pytest.raises(TypeError, match=r"use_gpu must be True, False or None. Received: use_gpu='yes'"):
        resolve_launch_options(spark, num_proc=1, use_gpu="yes")
    with pytest.raises(ValueError, match=r"use_gpu=True needs GPUs scheduled.*gpu.amount is None \(master=local"):
        resolve_launch_options(spark, num_proc=1, use_gpu=True)


def test_gpus_scheduled_to_the_tasks_turn_use_gpu_on_and_warm_ranks_off(no_mpi, monkeypatch):
    spark = _ConnectSession(**{"spark.task.resource.gpu.amount": "1"})
    opts = resolve_launch_options(spark, num_proc=2)
    assert opts.use_gpu is True and opts.warm is True and not opts.forks_warm
    assert resolve_launch_options(spark, num_proc=2, use_gpu=False).use_gpu is False
    monkeypatch.setattr(options_module, "_mpi_available", lambda: True)
    with pytest.raises(NotImplementedError, match=r"use_gpu with backend='mpi' is not built yet"):
        resolve_launch_options(spark, num_proc=2, backend="mpi")


def test_the_slot_pool_holds_a_later_job_until_the_slots_are_free():
    from hvd_spark._internal.driver.slots import _SlotPool

    pool, order = _SlotPool(), []
    with pool.claim("app", 5, 4, "first"):  # the first job of an application is never held back
        with pool.claim("other-app", 4, 4, "elsewhere"):  # another application's slots are its own
            pass

        def second():
            with pool.claim("app", 2, 4, "second"):
                order.append("second")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first ends")
    t.join(5)
    assert order == ["first ends", "second"]


def test_the_payload_pickles_or_names_what_does_not():
    import cloudpickle

    from hvd_spark._internal.driver.launcher import pickled_payload

    fn, args, kwargs = cloudpickle.loads(pickled_payload(lambda x, y=0: x + y, [1], {"y": 2}))
    assert fn(*args, **kwargs) == 3
    with pytest.raises(TypeError, match=r"fn must be callable. Received: int"):
        pickled_payload(3)
    with pytest.raises(TypeError, match=r"fn and its arguments must be picklable with cloudpickle"):
        pickled_payload(print, (threading.Lock(),))


def test_a_cancelled_stage_is_told_by_sparks_own_words():
    from hvd_spark._internal.driver.classic import _was_cancelled

    assert _was_cancelled(RuntimeError("Job 3 cancelled part of cancelled job group hvd_spark-ab12"))
    assert _was_cancelled(RuntimeError("An error occurred: SPARK_JOB_CANCELLED ..."))
    task = "Job aborted due to stage failure: Task 1 failed\nTraceback (most recent call last):\n  Job 2 cancelled"
    assert not _was_cancelled(RuntimeError(task))  # a rank's traceback that mentions a cancellation
