"""The fit's controller (ml/controller.py) as a state machine, and its two policies (ml/policies.py)
alone and replaced: which failures restart, how many ranks each attempt has, the states a fit goes
through, and the recoveries accounted for in one place. Ranks are played in process."""

import time

import pytest

from hvd_spark._internal.common.outcomes import HOST_UNREACHABLE, TASK_LOST
from hvd_spark._internal.data.store import Store
from hvd_spark._internal.ml import controller, policies
from hvd_spark._internal.ml.backend import InProcessBackend, in_process_rank
from hvd_spark._internal.ml.controller import Controller, State
from hvd_spark._internal.ml.policies import ElasticScaling, FailureDecision, FailurePolicy, FixedScaling
from hvd_spark.errors import (
    JobCancelledError,
    JobTimeoutError,
    LaunchError,
    RankFailedError,
    RankStalledError,
)
from tests.fast.test_elastic_planning import FAST, ElasticWriter, _elastic_cfg
from tests.fast.test_fit_planning import EpochWriter, _config, _ModelBytes

RESTART, RAISE, TAKEN = FailureDecision.RESTART, FailureDecision.RAISE, FailureDecision.TAKEN_OVER


def _failed(exc_type="ValueError", host=None):
    return RankFailedError(1, exc_type, "boom", host=host)


@pytest.mark.parametrize(
    "error, restarts, max_restarts, lease_lost, decision",
    [
        (_failed(), 0, 1, False, RESTART),
        (_failed(), 1, 1, False, RAISE),  # no restart left
        (_failed(), 0, 0, False, RAISE),
        (LaunchError("tasks did not start"), 0, 2, False, RESTART),
        (JobTimeoutError("too long"), 1, 2, False, RESTART),
        (RankStalledError("no progress"), 0, 1, False, RESTART),
        (_failed("hvd_spark.errors.DataChangedError"), 0, 3, False, RAISE),  # the files changed: never again
        (_failed("hvd_spark.errors.RunInUseError"), 0, 3, False, TAKEN),
        (_failed(), 0, 3, True, TAKEN),  # this fit's lease was lost meanwhile
        (JobCancelledError("cancelled"), 0, 3, False, RAISE),
        (ValueError("a bug on the driver"), 0, 3, False, RAISE),
    ],
)
def test_the_failure_policy_decides_each_failure(error, restarts, max_restarts, lease_lost, decision):
    assert FailurePolicy(max_restarts).decide(error, restarts, lease_lost=lease_lost) is decision


def test_the_failure_policy_names_a_lost_host_only_for_lost_executors_and_networks():
    assert FailurePolicy.lost_host(_failed(TASK_LOST, host="h1")) == "h1"
    assert FailurePolicy.lost_host(_failed(HOST_UNREACHABLE, host="h2")) == "h2"
    assert FailurePolicy.lost_host(_failed("ValueError", host="h3")) is None  # the rank's own code failed
    assert FailurePolicy.lost_host(_failed(TASK_LOST)) is None
    assert FailurePolicy.lost_host(LaunchError("x")) is None


def test_fixed_scaling_keeps_the_backends_ranks():
    backend = InProcessBackend(3)
    scaling = FixedScaling()
    assert scaling.first_size(backend) == 3 and scaling.backend_for(backend, 3) is backend
    assert scaling.after_failure(backend, 3, "h1", 1) == 3 and not scaling.resizes


def test_elastic_scaling_sizes_by_slots_and_drops_a_lost_executor_spark_still_counts():
    backend = InProcessBackend(4)
    scaling = ElasticScaling(policies.Elastic(min_num_proc=2, max_num_proc=3, timeout=1, initial=2, **FAST))
    assert scaling.first_size(backend) == 2  # 4 slots, max 3, the first attempt at most num_proc=2
    assert scaling.backend_for(backend, 3).num_processes() == 3
    assert scaling.after_failure(backend, 3, None, 1) == 3  # a failure of the code: the slots there are
    assert scaling.after_failure(backend, 3, "h9", 1) == 2  # the lost executor is still counted: one fewer
    assert scaling.after_failure(backend, 2, "h9", 1) == 3  # never below min_num_proc: the slots decide
    backend.slots = 1
    with pytest.raises(Exception, match="min_num_proc=2"):
        scaling.after_stop(backend, 2)


def _controller(store, backend, rank_fn, cfg, **policies_):
    return Controller(
        backend,
        rank_fn,
        cfg,
        store,
        failure=policies_.get("failure", FailurePolicy(1)),
        scaling=policies_.get("scaling", FixedScaling()),
        model_bytes=_ModelBytes(),
    )


def test_a_fit_without_failures_goes_straight_through(tmp_path):
    store = Store(str(tmp_path))
    c = _controller(store, InProcessBackend(2), EpochWriter(), _config(store, "r", 2))
    trained = c.run()
    assert c.states == [State.SCHEDULING, State.RUNNING, State.FINISHED]
    assert trained.restarts == 0 and trained.recoveries == () and len(trained.results) == 2


def test_a_failure_restarts_and_is_accounted_once(tmp_path):
    store = Store(str(tmp_path))
    writer = EpochWriter({2: (1, _failed(TASK_LOST, host="h1"))})
    c = _controller(store, InProcessBackend(2), writer, _config(store, "r", 3))
    trained = c.run()
    assert c.states == [State.SCHEDULING, State.RUNNING, State.RESTARTING, State.RUNNING, State.FINISHED]
    assert trained.restarts == 1
    (recovery,) = trained.recoveries
    assert (recovery.kind, recovery.from_size, recovery.to_size, recovery.resumed_from) == ("restart", 2, 2, "epoch 1")
    assert recovery.lost_hosts == ("h1",) and c.lost_hosts == {"h1"}
    assert [cfg.start.initial_epoch for cfg in writer.seen] == [0, 1]


def test_an_error_ends_in_the_errored_state_with_the_error_unchanged(tmp_path):
    store = Store(str(tmp_path))
    error = _failed()
    writer = EpochWriter({1: (0, error)})
    c = _controller(store, InProcessBackend(2), writer, _config(store, "r", 2), failure=FailurePolicy(0))
    with pytest.raises(RankFailedError) as got:
        c.run()
    assert got.value is error
    assert c.states == [State.SCHEDULING, State.RUNNING, State.RESTARTING, State.ERRORED]


def test_a_replaced_failure_policy_is_the_one_asked(tmp_path):
    class NeverAfterALaunchError(FailurePolicy):
        def decide(self, error, restarts_so_far, lease_lost=False):
            self.asked.append(type(error).__name__)
            return RAISE if isinstance(error, LaunchError) else super().decide(error, restarts_so_far, lease_lost)

    store = Store(str(tmp_path))
    policy = NeverAfterALaunchError(5)
    object.__setattr__(policy, "asked", [])
    writer = EpochWriter({1: (0, LaunchError("the stage broke"))})
    with pytest.raises(LaunchError):
        _controller(store, InProcessBackend(2), writer, _config(store, "r", 2), failure=policy).run()
    assert policy.asked == ["LaunchError"]  # the default policy would have restarted it (max_restarts=5)


def test_an_elastic_fit_shrinks_then_resizes_through_its_states(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    writer = ElasticWriter(backend, {2: "lose", 3: "return"})
    scaling = ElasticScaling(policies.Elastic(min_num_proc=2, max_num_proc=3, timeout=5, **FAST))
    c = _controller(store, backend, writer, _elastic_cfg(store, "r", 5), scaling=scaling)
    trained = c.run()
    assert c.states == [
        State.SCHEDULING,
        State.RUNNING,
        State.RESTARTING,
        State.RUNNING,
        State.RESIZING,
        State.RUNNING,
        State.FINISHED,
    ]
    assert writer.sizes == [3, 2, 3] and [r.kind for r in trained.recoveries] == ["shrink", "grow"]
    assert trained.restarts == 1


def test_a_timeout_after_a_lost_host_keeps_the_timeout_as_its_cause(tmp_path):
    store = Store(str(tmp_path))
    timeout = JobTimeoutError("the job ran past timeout=5s")
    writer = EpochWriter({1: (1, _failed(TASK_LOST, host="h7")), 2: (0, timeout)})
    with pytest.raises(JobTimeoutError) as got:
        controller.train_with_restarts(
            InProcessBackend(2), writer, _config(store, "r", 3), store, max_restarts=1, model_bytes=_ModelBytes()
        )
    assert "lost host(s) ['h7']" in str(got.value) and got.value.__cause__ is timeout


@pytest.mark.parametrize("slots, event, kind", [(3, "lose", "shrink"), (2, "return", "grow")])
def test_a_recoverys_time_runs_from_the_failure_or_stop_slot_waits_included(tmp_path, slots, event, kind):
    """A grow's time runs from the ranks' stop (before: from after the wait for the slots, about 0 s)."""
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    backend.slots = slots
    writer = ElasticWriter(backend, {2: event})
    probe = controller.AttemptProbe()

    def rank_fn(cfg):  # rank 0 reports its first step at once, as a rank's position events do
        if in_process_rank().rank == 0:
            probe(0, {"kind": "position", "iterations": 1, "time": time.time()})
        return writer(cfg)

    scaling = ElasticScaling(policies.Elastic(min_num_proc=2, max_num_proc=3, timeout=5, poll=0.05, settle=0.3))
    c = Controller(
        backend,
        rank_fn,
        _elastic_cfg(store, "r", 3),
        store,
        failure=FailurePolicy(1),
        scaling=scaling,
        model_bytes=_ModelBytes(),
        probe=probe,
    )
    (recovery,) = c.run().recoveries
    assert recovery.kind == kind
    assert recovery.seconds is not None and recovery.seconds >= 0.3  # the settle wait counts


def test_run_restarts_what_a_fit_would_call_taken_over():
    error = _failed("hvd_spark.errors.RunInUseError")
    assert FailurePolicy(1, holds_run=False).decide(error, 0) is RESTART
    assert FailurePolicy(1, holds_run=False).decide(error, 0, lease_lost=True) is RESTART


def test_an_error_while_starting_again_names_the_failure_before_it(tmp_path):
    store = Store(str(tmp_path))
    backend = InProcessBackend(3)
    first = _failed(TASK_LOST, host="h1")

    class Gone(ElasticScaling):
        def after_failure(self, backend, size, lost_host, attempt):
            raise RuntimeError("no slots")

    writer = EpochWriter({1: (1, first)})
    scaling = Gone(policies.Elastic(min_num_proc=1, max_num_proc=3, timeout=1, **FAST))
    c = _controller(store, backend, writer, _config(store, "r", 2), scaling=scaling)
    with pytest.raises(RuntimeError) as got:
        c.run()
    assert got.value.__context__ is first
