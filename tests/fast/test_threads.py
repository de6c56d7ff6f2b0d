"""A rank's TensorFlow thread counts: the environment's (backend_env's) explicit counts win over the
task's CPUs, each pool on its own."""

from hvd_spark._internal.rank.threads import thread_counts


def test_num_threads_sets_both_pools_when_the_environment_is_silent():
    assert thread_counts(2, {}) == (2, 2)


def test_backend_env_counts_win_each_on_its_own():
    assert thread_counts(1, {"TF_NUM_INTEROP_THREADS": "2"}) == (1, 2)
    assert thread_counts(1, {"TF_NUM_INTRAOP_THREADS": "3"}) == (3, 1)
    assert thread_counts(None, {"TF_NUM_INTRAOP_THREADS": "2", "TF_NUM_INTEROP_THREADS": "4"}) == (2, 4)


def test_unset_zero_or_garbage_falls_back():
    assert thread_counts(None, {}) == (None, None)
    assert thread_counts(1, {"TF_NUM_INTRAOP_THREADS": "0", "TF_NUM_INTEROP_THREADS": "x"}) == (1, 1)
