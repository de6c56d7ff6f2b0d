"""Settings on a real Spark job: an explicit ``run(warm=...)`` wins over ``HVD_SPARK_WARM`` in the
tasks' environment (a job's ``env`` is part of it), and the ranks started fresh still die with
their task's process group (their process is the command itself, not a wrapper)."""

import os
import sys

import pytest

import hvd_spark


def where_am_i():
    return {
        "warm": os.environ.get("HVD_SPARK_WARM_RANK") == "1",
        "name": open("/proc/self/comm").read().strip(),
        "own_group": os.getpgid(0) == os.getpid(),
        "cmdline": open("/proc/self/cmdline").read().split("\0")[:3],
    }


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_the_warm_argument_wins_over_the_environment(spark):
    from hvd_spark._internal.task.barrier import RANK_NAME

    warm = hvd_spark.run(where_am_i, num_proc=2, spark=spark, verbose=0, warm=True, env={"HVD_SPARK_WARM": "0"})
    assert all(r["warm"] and r["name"] == RANK_NAME for r in warm), warm
    fresh = hvd_spark.run(where_am_i, num_proc=2, spark=spark, verbose=0, warm=False, env={"HVD_SPARK_WARM": "1"})
    assert not any(r["warm"] for r in fresh), fresh
    # A fresh rank runs its entry module itself (the wrapper exec'd it) in a process group of its own.
    assert all(r["own_group"] and r["cmdline"][1:3] == ["-m", "hvd_spark._internal.rank.entry"] for r in fresh), fresh
