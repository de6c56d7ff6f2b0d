"""Pure functions of the launcher: no Spark, no processes."""

import pytest

from hvd_spark._internal.common.settings import parse_bool, parse_seconds
from hvd_spark._internal.common.topology import assign_ranks, horovod_env, task_cpus, task_slots


def test_assign_ranks_single_host():
    ranks = assign_ranks(["h", "h", "h"])
    assert [r.rank for r in ranks] == [0, 1, 2]
    assert [r.local_rank for r in ranks] == [0, 1, 2]
    assert {r.local_size for r in ranks} == {3}
    assert {(r.cross_rank, r.cross_size) for r in ranks} == {(0, 1)}


def test_assign_ranks_interleaved_hosts_are_contiguous():
    # Tasks 0..4 landed on hosts a, b, a, b, a.
    ranks = assign_ranks(["a", "b", "a", "b", "a"])
    by_task = [(r.rank, r.host, r.local_rank, r.local_size, r.cross_rank, r.cross_size) for r in ranks]
    assert by_task == [
        (0, "a", 0, 3, 0, 2),
        (3, "b", 0, 2, 1, 2),
        (1, "a", 1, 3, 0, 2),
        (4, "b", 1, 2, 1, 2),
        (2, "a", 2, 3, 0, 1),  # only host a has a local rank 2
    ]
    assert sorted(r.rank for r in ranks) == list(range(5))
    assert {r.size for r in ranks} == {5}


def test_assign_ranks_matches_horovod_host_assignment():
    hosts_mod = pytest.importorskip("horovod.runner.common.util.hosts")
    hosts = ["a", "b", "a", "b", "a", "c"]
    ours = sorted(assign_ranks(hosts), key=lambda r: r.rank)
    theirs = hosts_mod.get_host_assignments(hosts_mod.parse_hosts("a:3,b:2,c:1"), len(hosts))
    assert [(r.host, r.rank, r.local_rank, r.local_size, r.cross_rank, r.cross_size) for r in ours] == [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in theirs
    ]


def test_assign_ranks_rejects_empty():
    with pytest.raises(ValueError, match="at least one host"):
        assign_ranks([])


def test_horovod_env_gloo():
    info = assign_ranks(["h", "h"])[1]
    env = horovod_env(info, rendezvous_addr="127.0.0.1", rendezvous_port=4242, iface="lo", num_threads=2)
    assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_SIZE"] == "2"
    assert env["HOROVOD_LOCAL_RANK"] == "1" and env["HOROVOD_LOCAL_SIZE"] == "2"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["HOROVOD_GLOO_IFACE"] == "lo"
    assert env["TF_NUM_INTRAOP_THREADS"] == "2" and env["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="controller"):
        horovod_env(info, rendezvous_addr="x", rendezvous_port=1, iface="lo", controller="mpi")


@pytest.mark.parametrize(
    "master,cpus,expected",
    [
        ("local", 1, 1),
        ("local[2]", 1, 2),
        ("local[4]", 2, 2),
        ("local[*]", 1, 8),
        ("local[3, 2]", 1, 3),
        ("local-cluster[2,1,1024]", 1, 2),
        ("local-cluster[2, 4, 1024]", 2, 4),
        ("local[1]", 2, 0),
        ("spark://127.0.0.1:7077", 1, 6),
        ("yarn", 2, 3),
    ],
)
def test_task_slots(master, cpus, expected):
    assert task_slots(master, default_parallelism=6, task_cpus=cpus, cpu_count=8) == expected


def test_settings_parsers():
    assert parse_bool("X", "Yes") is True and parse_bool("X", "0") is False
    with pytest.raises(ValueError, match="X must be one of"):
        parse_bool("X", "maybe")
    parsed = parse_seconds("t", "2.5")
    assert parsed == 2.5
    with pytest.raises(ValueError, match="t must be greater than 0"):
        parse_seconds("t", 0)
    with pytest.raises(ValueError, match="t must be a number of seconds"):
        parse_seconds("t", "soon")


def test_task_cpus_from_conf():
    assert task_cpus({}) == 1 and task_cpus({"spark.task.cpus": "4"}) == 4
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"spark.task.cpus must be a positive integer. Received: '{bad}'"):
            task_cpus({"spark.task.cpus": bad})


# --- GPUs (simulated: no GPU exists here; these are the decisions, as pure functions) ---


def test_a_gpu_rank_sees_exactly_its_tasks_gpus_with_memory_growth():
    from hvd_spark._internal.common.topology import gpu_env

    env = gpu_env(["2", "3"], True, {})
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "TF_FORCE_GPU_ALLOW_GROWTH": "true", "HVD_SPARK_GPUS": "2,3"}
    # The user's own choices win.
    mine = gpu_env(["2"], True, {"CUDA_VISIBLE_DEVICES": "5", "TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert mine["CUDA_VISIBLE_DEVICES"] == "5" and mine["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"


def test_a_cpu_job_hides_the_gpus_of_its_tasks_and_leaves_gpu_less_tasks_alone():
    from hvd_spark._internal.common.topology import gpu_env

    assert gpu_env(["0"], False, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert gpu_env(None, False, {}) == {}
    assert gpu_env(["0"], False, {"CUDA_VISIBLE_DEVICES": "0"}) == {}


def test_gpus_asked_for_and_none_assigned_name_the_spark_conf_keys():
    from hvd_spark._internal.common.topology import gpu_env

    with pytest.raises(ValueError, match=r"use_gpu=True, but Spark assigned no GPU to this barrier task") as e:
        gpu_env(None, True, {})
    for key in ("spark.task.resource.gpu.amount", "spark.executor.resource.gpu.amount", "discoveryScript"):
        assert key in str(e.value)


def test_nccl_carries_gpu_collectives_only_when_built_and_not_chosen_by_the_user():
    from hvd_spark._internal.common.topology import gpu_operations

    gpu = {"HVD_SPARK_GPUS": "0"}
    assert gpu_operations(True, gpu) == {"HOROVOD_GPU_OPERATIONS": "NCCL"}
    assert gpu_operations(False, gpu) == {}  # Horovod without NCCL: host copies and Gloo / MPI
    assert gpu_operations(True, {}) == {}  # a CPU rank
    assert gpu_operations(True, {**gpu, "HOROVOD_GPU_ALLREDUCE": "MPI"}) == {}


@pytest.mark.parametrize("raw,amount", [(None, 0.0), ("1", 1.0), ("0.5", 0.5)])
def test_task_gpu_amount_reads_the_spark_conf(raw, amount):
    from hvd_spark._internal.common.topology import task_gpu_amount

    conf = {} if raw is None else {"spark.task.resource.gpu.amount": raw}
    assert task_gpu_amount(conf) == amount


@pytest.mark.parametrize(
    "addresses,visible,device",
    [
        (["1"], None, "/GPU:1"),  # TensorFlow numbers the physical GPUs when nothing restricts them
        (["3"], "2,3", "/GPU:1"),  # ... or their positions in CUDA_VISIBLE_DEVICES
        (["0"], "1", None),  # the assigned GPU is hidden from this worker: stay on the CPU
        (None, None, None),  # a task without GPUs
    ],
)
def test_transform_places_the_model_on_its_tasks_gpu(addresses, visible, device):
    from hvd_spark._internal.infer.device import gpu_device

    assert gpu_device(addresses, visible) == device


# --- Slots that exist: the decision on the executors that registered ---


def test_only_local_masters_are_read_from_the_url():
    from hvd_spark._internal.common.topology import is_local_master, slots_from_master_url

    for master in ("local", "local[2]", "local[*]", "local[3, 2]", "local-cluster[2,1,1024]"):
        assert slots_from_master_url(master), master
    for master in ("spark://h:7077", "yarn", "k8s://https://api:6443"):
        assert not slots_from_master_url(master), master
    assert is_local_master("local[2]") and not is_local_master("local-cluster[2,1,1024]")


@pytest.mark.parametrize(
    "master,conf,refused",
    [
        ("spark://h:7077", {"spark.dynamicAllocation.enabled": "true"}, True),
        ("yarn", {"spark.dynamicAllocation.enabled": "True"}, True),
        ("local-cluster[2,1,1024]", {"spark.dynamicAllocation.enabled": "true"}, True),
        ("local[2]", {"spark.dynamicAllocation.enabled": "true"}, False),  # Spark ignores it on local masters
        ("local[2]", {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.testing": "true"}, True),
        ("yarn", {"spark.dynamicAllocation.enabled": "false"}, False),
        ("yarn", {}, False),
    ],
)
def test_dynamic_allocation_is_refused_as_spark_refuses_barrier_stages(master, conf, refused):
    from hvd_spark._internal.common.topology import barrier_refusal

    message = barrier_refusal(master, conf)
    assert (message is not None) == refused
    if refused:
        assert "spark.dynamicAllocation.enabled=false" in message and f"master={master}" in message


@pytest.mark.parametrize(
    "master,conf,cpus,expected",
    [
        ("yarn", {}, 1, (2, 1, False)),  # Spark's default: 2 executors of 1 core
        ("yarn", {"spark.executor.instances": "4", "spark.executor.cores": "4"}, 2, (4, 2, False)),
        ("k8s://https://api:6443", {"spark.executor.instances": "3"}, 1, (3, 1, False)),
        ("spark://h:7077", {"spark.cores.max": "8", "spark.executor.cores": "2"}, 1, (4, 2, True)),
        ("spark://h:7077", {"spark.executor.instances": "5"}, 1, (None, None, True)),  # not read by standalone
        ("spark://h:7077", {"spark.executor.cores": "4"}, 2, (None, 2, True)),
    ],
)
def test_executor_target_from_the_conf(master, conf, cpus, expected):
    from hvd_spark._internal.common.topology import executor_target

    target = executor_target(master, conf, cpus)
    assert (target.executors, target.slots_each, target.settles) == expected


def test_executors_settle_on_enough_slots_all_asked_for_or_a_standalone_count_that_holds_still():
    from hvd_spark._internal.common.topology import executor_target, executors_settled

    yarn = executor_target("yarn", {"spark.executor.instances": "4"})
    standalone = executor_target("spark://h:7077", {})
    assert executors_settled(2, 2, 2, yarn, 0.0, 5.0)  # enough for num_proc
    assert not executors_settled(None, 2, 2, yarn, 60.0, 5.0)  # YARN grants the other 2 later
    assert executors_settled(None, 4, 4, yarn, 0.0, 5.0)
    assert not executors_settled(None, 2, 4, standalone, 1.0, 5.0)
    assert executors_settled(None, 2, 4, standalone, 5.0, 5.0)
    assert not executors_settled(None, 0, 0, standalone, 60.0, 5.0)  # nothing registered never settles


def _judge(num_proc, executors, slots, master="spark://h:7077", conf=None, settled=True, waited=0.0, **kw):
    from hvd_spark._internal.common.topology import executor_target, judge_slots

    conf = {"spark.cores.max": "2", "spark.executor.cores": "1"} if conf is None else conf
    cpus = kw.pop("task_cpus", 1)
    target = executor_target(master, conf, cpus)
    return judge_slots(
        num_proc,
        executors=executors,
        slots=slots,
        target=target,
        settled=settled,
        waited=waited,
        master=master,
        task_cpus=cpus,
        **kw,
    )


def test_more_ranks_than_a_complete_set_of_executors_has_is_refused_with_the_numbers():
    # The standalone cluster of tests/test_cluster.py: 1 Worker of 2 cores, spark.default.parallelism=8.
    verdict = _judge(3, 2, 2, default_parallelism="8", waited=3.2)
    assert verdict.error and verdict.error.startswith(
        "num_proc must be at most the number of task slots (2) for a barrier stage. Received: num_proc=3."
    )
    for part in (
        "2 executors registered of the 2 asked for (spark.cores.max=2 / spark.executor.cores=1)",
        "with 2 task slots in all (spark.task.cpus=1; master=spark://h:7077)",
        "spark.default.parallelism=8 is not the executors' cores",
        "waited 3s",
        "could never start",
        "Lower num_proc to at most 2",
        "spark.cores.max",
    ):
        assert part in verdict.error, part
    assert _judge(2, 2, 2, default_parallelism="8") == _judge(None, 2, 2, default_parallelism="8")
    assert _judge(None, 2, 2).slots == 2 and _judge(None, 2, 2).warning is None


def test_missing_executors_refuse_only_what_all_of_them_could_not_hold():
    yarn = {"spark.executor.instances": "4", "spark.executor.cores": "2"}
    # 1 of 4 executors after the wait, 2 slots each: 8 slots once all are there.
    fits = _judge(6, 1, 2, master="yarn", conf=yarn, settled=False, waited=30)
    assert fits.error is None and fits.slots == 8 and "wait for more executors" in fits.warning
    never = _judge(9, 1, 2, master="yarn", conf=yarn, settled=False, waited=30)
    assert never.error and "task slots (8) the application can have" in never.error
    assert "asked for 4 executors (spark.executor.instances=4) of 2 task slots each" in never.error
    # Nothing registered yet: the conf alone bounds it (YARN: spark.executor.cores, default 1).
    assert _judge(3, 0, 0, master="yarn", conf={}, settled=False, waited=30).error  # 2 x 1 slot
    assert _judge(2, 0, 0, master="yarn", conf={}, settled=False, waited=30).slots == 2
    # A standalone application whose executors' size the conf does not tell: no bound, it waits.
    unknown = _judge(3, 0, 0, conf={}, settled=False, waited=30)
    assert unknown.error is None and unknown.slots == 3 and unknown.warning


def test_num_proc_defaults_to_registered_slots_and_needs_some():
    partial = _judge(None, 1, 2, master="yarn", conf={"spark.executor.instances": "4"}, settled=False, waited=30)
    assert partial.slots == 2 and "defaults to the task slots registered so far (2)" in partial.warning
    none = _judge(None, 0, 0, master="yarn", conf={}, settled=False, waited=30, wait_setting="HVD_SPARK_EXECUTOR_WAIT")
    assert none.error and "has none yet" in none.error and "HVD_SPARK_EXECUTOR_WAIT" in none.error


class _FakeConnectConf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _FakeConnectSession:
    """Looks like a Spark Connect session to hvd_spark (its module), with a conf and nothing else."""

    session_id = "fake"

    def __init__(self, conf):
        self.conf = _FakeConnectConf(conf)

    def range(self, *args):
        raise AssertionError("the slots must not be counted from range() when spark.default.parallelism is set")


_FakeConnectSession.__module__ = "pyspark.sql.connect.session"


def test_connect_with_default_parallelism_set_asks_for_num_proc():
    from hvd_spark._internal.driver.options import resolve_launch_options

    spark = _FakeConnectSession({"spark.master": "spark://h:7077", "spark.default.parallelism": "8"})
    with pytest.raises(ValueError, match=r"num_proc is required on this Spark Connect session.*spark.default.para"):
        resolve_launch_options(spark, num_proc=None)
    assert resolve_launch_options(spark, num_proc=3).num_proc == 3  # Spark's own barrier check has the last word


def test_connect_with_dynamic_allocation_is_refused_before_any_work():
    from hvd_spark._internal.driver.options import resolve_launch_options

    spark = _FakeConnectSession({"spark.master": "yarn", "spark.dynamicAllocation.enabled": "true"})
    with pytest.raises(ValueError, match=r"Spark does not run barrier stages with dynamic allocation"):
        resolve_launch_options(spark, num_proc=2)


class _FakeScheduler:
    """The JVM side ``_registered_slots`` reads through py4j, with executors that register as it
    keeps counting: ``timeline`` is ``[(counts read before, executors, slots), ...]``, and ``reads``
    says how many times the launcher counted (so a test sees whether, and how long, it waited)."""

    def __init__(self, timeline):
        self._timeline, self.reads = timeline, 0

    def _now(self):
        return max(((n, s) for at, n, s in self._timeline if at <= self.reads), default=(0, 0))

    def _count(self):
        now = self._now()
        self.reads += 1
        return now

    def resourceProfileManager(self):  # noqa: N802 (the JVM's names)
        return self

    def defaultResourceProfile(self):  # noqa: N802
        return "default"

    def getExecutorIds(self):  # noqa: N802 (read first: one count is this call and the next)
        return _Size(self._now()[0])

    def maxNumConcurrentTasks(self, profile):  # noqa: N802
        return self._count()[1]


class _Size:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


class _FakeContext:
    def __init__(self, master, timeline, app="app-1"):
        self.master, self.applicationId, self.defaultParallelism = master, app, 8
        scheduler = self.scheduler = _FakeScheduler(timeline) if timeline is not None else None
        self._jsc = type("J", (), {"sc": lambda _self: scheduler if scheduler else 1 / 0})()


def test_the_launch_waits_for_the_executors_then_counts_their_slots(monkeypatch, caplog):
    import logging

    from hvd_spark._internal.driver import slots

    standalone = {"spark.cores.max": "2", "spark.executor.cores": "1", "spark.default.parallelism": "8"}
    sc = _FakeContext("spark://h:7077", [(1, 1, 1), (2, 2, 2)])
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        assert slots._registered_slots(sc, standalone, None, None) == 2
    # It counted until both executors asked for were there, and not once more.
    assert sc.scheduler.reads == 3
    assert "waiting up to 30s for the executors to register (2 asked for: spark.cores.max=2" in caplog.text
    assert "2 executors registered with 2 task slots" in caplog.text
    sc = _FakeContext("spark://h:7077", [(1, 2, 2)])
    with pytest.raises(ValueError, match=r"task slots \(2\).*num_proc=3.*2 executors registered.*spark.task.cpus=1"):
        slots._registered_slots(sc, standalone, 3, None)
    assert sc.scheduler.reads == 2  # refused as soon as every executor asked for was there
    # No JVM access: defaultParallelism / spark.task.cpus.
    assert slots._registered_slots(_FakeContext("spark://h:7077", None), {"spark.task.cpus": "2"}, None, None) == 4


def test_a_standalone_count_that_holds_still_is_complete_and_remembered(monkeypatch):
    from hvd_spark._internal.common import settings
    from hvd_spark._internal.driver import slots

    monkeypatch.setattr(settings, "EXECUTORS_SETTLE", 0.5)
    sc = _FakeContext("spark://h:7077", [(0, 3, 6)], app="app-settle")
    assert slots._registered_slots(sc, {}, None, None) == 6
    first = sc.scheduler.reads
    assert first >= 2  # counted again until the count had held still
    assert slots._registered_slots(sc, {}, None, None) == 6
    assert sc.scheduler.reads == first + 1  # known complete: one count, no second wait


def test_missing_yarn_executors_bound_the_ranks_after_the_wait(monkeypatch, caplog):
    import logging

    from hvd_spark._internal.driver import slots

    monkeypatch.setenv("HVD_SPARK_EXECUTOR_WAIT", "0.5")
    yarn = {"spark.executor.instances": "4", "spark.executor.cores": "2"}

    def sc():
        return _FakeContext("yarn", [(0, 1, 2)])

    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        assert slots._registered_slots(sc(), yarn, 6, None) == 8  # the 4 executors asked for would hold 6
    assert "the barrier tasks wait for more executors" in caplog.text
    with pytest.raises(ValueError, match=r"task slots \(8\) the application can have"):
        slots._registered_slots(sc(), yarn, 9, None)
    assert slots._registered_slots(sc(), yarn, None, None) == 2
    # start_timeout bounds the wait too.
    monkeypatch.setenv("HVD_SPARK_EXECUTOR_WAIT", "600")
    assert slots._registered_slots(sc(), yarn, 6, 0.3) == 8


# -- rank layout ---------------------------------------------------------------------------------


def test_host_layout_trains_one_rank_on_all_of_a_local_masters_cores():
    from hvd_spark._internal.common.topology import plan_layout

    one = plan_layout("host", master="local[8]", num_proc=None, slots=8, executors=None, task_cpus=1, profiles=False)
    assert (one.num_proc, one.threads, one.task_cpus) == (1, 8, None)
    two = plan_layout("host", master="local[8]", num_proc=2, slots=8, executors=None, task_cpus=1, profiles=False)
    assert (two.num_proc, two.threads) == (2, 4)  # the cores shared among the ranks asked for
    many = plan_layout("host", master="local[4]", num_proc=4, slots=2, executors=None, task_cpus=2, profiles=False)
    assert (many.num_proc, many.threads) == (4, 2)  # never fewer threads than spark.task.cpus
    slot = plan_layout("slot", master="local[8]", num_proc=None, slots=8, executors=None, task_cpus=1, profiles=False)
    assert (slot.num_proc, slot.threads, slot.task_cpus) == (8, 1, None)


def test_host_layout_on_a_cluster_asks_each_barrier_task_for_its_executors_cores():
    from hvd_spark._internal.common.topology import plan_layout

    # 3 executors of 4 cores (spark.task.cpus=1: 12 slots)
    a = plan_layout("host", master="spark://m:7077", num_proc=None, slots=12, executors=3, task_cpus=1, profiles=True)
    assert (a.num_proc, a.threads, a.task_cpus) == (3, 4, 4)
    b = plan_layout("host", master="spark://m:7077", num_proc=6, slots=12, executors=3, task_cpus=1, profiles=True)
    assert (b.num_proc, b.threads, b.task_cpus) == (6, 2, 2)  # two ranks per executor, half its cores each
    c = plan_layout("host", master="spark://m:7077", num_proc=12, slots=12, executors=3, task_cpus=1, profiles=True)
    assert (c.num_proc, c.threads, c.task_cpus) == (12, 1, None)  # a core each: the default profile
    # no stage-level scheduling: one rank per slot, and the log line says how to give a rank more cores
    d = plan_layout("host", master="yarn", num_proc=None, slots=12, executors=3, task_cpus=1, profiles=False)
    assert (d.num_proc, d.threads, d.task_cpus) == (12, 1, None) and "spark.task.cpus" in d.why
    # executors of 1 core (local-cluster[3,1,...]): nothing to gain, nothing asked
    e = plan_layout(
        "host", master="local-cluster[3,1,1024]", num_proc=None, slots=3, executors=3, task_cpus=1, profiles=True
    )
    assert (e.num_proc, e.threads, e.task_cpus) == (3, 1, None)
    # GPUs: a rank per GPU task, whatever the layout
    g = plan_layout(
        "host", master="local[4]", num_proc=None, slots=4, executors=None, task_cpus=1, profiles=False, use_gpu=True
    )
    assert (g.num_proc, g.threads) == (4, 1)


def test_stage_profiles_follow_sparks_support():
    from hvd_spark._internal.common.topology import stage_profiles_supported

    off = {"spark.dynamicAllocation.enabled": "true"}
    assert stage_profiles_supported("spark://m:7077", "3.4.1", {})
    assert stage_profiles_supported("local-cluster[2,2,1024]", "4.3.0", {})
    assert not stage_profiles_supported("spark://m:7077", "3.3.2", {})
    assert stage_profiles_supported("yarn", "3.5.0", {}) and not stage_profiles_supported("yarn", "3.4.1", {})
    assert not stage_profiles_supported("k8s://https://h", "4.0.0", off)
    assert not stage_profiles_supported("local[4]", "4.3.0", {})


def test_the_rank_layout_setting_names_its_values():
    from hvd_spark._internal.common import settings

    assert settings.RANK_LAYOUT.get(None, env={}, conf={}) == "host"
    assert settings.RANK_LAYOUT.get(None, env={"HVD_SPARK_RANK_LAYOUT": " Slot "}, conf={}) == "slot"
    with pytest.raises(ValueError, match=r"HVD_SPARK_RANK_LAYOUT must be one of \['host', 'slot'\]. Received: 'core'"):
        settings.RANK_LAYOUT.get(None, env={"HVD_SPARK_RANK_LAYOUT": "core"}, conf={})


def _torch(ranks, task):
    from hvd_spark._internal.common.topology import node_of, torch_env

    node, nodes = node_of(ranks[task], ranks)
    return torch_env(
        ranks[task], node=node, nodes=nodes, master_addr="10.0.0.2", master_port=29500, run_id="hvd_spark-x", iface="e0"
    )


def test_torch_env_is_torchruns_with_one_node_per_host():
    """What torch.distributed's env:// init and a torchrun / TorchDistributor function read: the
    local rank within its host, the host as the node, rank 0's address and port for every rank."""
    ranks = assign_ranks(["b", "a", "b", "a", "b"])  # host b first (task 0), 3 ranks on b, 2 on a
    envs = [_torch(ranks, t) for t in range(5)]
    got = [
        (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["GROUP_RANK"], e["ROLE_RANK"])
        for e in envs
    ]
    assert got == [
        ("0", "0", "3", "0", "0", "0"),
        ("3", "0", "2", "1", "1", "3"),
        ("1", "1", "3", "0", "0", "1"),
        ("4", "1", "2", "1", "1", "4"),
        ("2", "2", "3", "0", "0", "2"),
    ]
    for e in envs:
        sizes = (e["WORLD_SIZE"], e["ROLE_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"])
        assert sizes == ("5", "5", "2", "default")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) == ("10.0.0.2", "29500", "hvd_spark-x")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0's init serves the store, no agent does
        assert e["GLOO_SOCKET_IFNAME"] == "e0"
    from hvd_spark._internal.common.topology import TORCH_ENV

    assert set(envs[0]) == set(TORCH_ENV)  # the names warm servers are not keyed by


def test_mpi_torch_env_matches_the_gloo_ranks_layout():
    """mpirun lays ranks out as assign_ranks does; a rank's variables from its MPI rank and the ranks per
    host are the ones a Gloo rank's task gives it (GLOO_SOCKET_IFNAME aside: mpirun's ranks have no task)."""
    from hvd_spark._internal.common.topology import mpi_torch_env

    ranks = assign_ranks(["b", "a", "b", "a", "b"])
    shared = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "hvd_spark-x"}
    for task, info in enumerate(ranks):
        expected = _torch(ranks, task)
        del expected["GLOO_SOCKET_IFNAME"]
        assert mpi_torch_env(info.rank, [3, 2], shared) == expected
    with pytest.raises(ValueError, match="rank 5 is not on any of the job's hosts"):
        mpi_torch_env(5, [3, 2], shared)
