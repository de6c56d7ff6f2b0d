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


class _FakeThreading:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def set_intra_op_parallelism_threads(self, n):
        self.calls.append(("intra", n))

    def set_inter_op_parallelism_threads(self, n):
        self.calls.append(("inter", n))


def _applied(monkeypatch, env: dict, **kw) -> list[tuple[str, int]]:
    """What set_threads hands TensorFlow, with a stand-in ``tensorflow`` module (no TF import here)."""
    import sys
    import types

    from hvd_spark._internal.rank.threads import set_threads

    fake = _FakeThreading()
    tf = types.ModuleType("tensorflow")
    tf.config = types.SimpleNamespace(threading=fake)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorflow", tf)
    for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    set_threads(1, **kw)
    return fake.calls


def test_a_rank_applies_backend_env_counts(monkeypatch):
    calls = _applied(monkeypatch, {"TF_NUM_INTEROP_THREADS": "2"}, environment_wins=True)
    assert calls == [("intra", 1), ("inter", 2)]


def test_a_transform_worker_keeps_task_cpus_whatever_its_environment(monkeypatch):
    assert _applied(monkeypatch, {"TF_NUM_INTRAOP_THREADS": "8"}) == [("intra", 1), ("inter", 1)]
