"""Pure functions of the launcher: no Spark, no processes."""

import pytest

from hvd_spark._internal.settings import parse_bool, parse_seconds
from hvd_spark._internal.topology import assign_ranks, horovod_env, task_cpus, task_slots


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
    from hvd_spark._internal.topology import gpu_env

    env = gpu_env(["2", "3"], True, {})
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "TF_FORCE_GPU_ALLOW_GROWTH": "true", "HVD_SPARK_GPUS": "2,3"}
    # The user's own choices win.
    mine = gpu_env(["2"], True, {"CUDA_VISIBLE_DEVICES": "5", "TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert mine["CUDA_VISIBLE_DEVICES"] == "5" and mine["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"


def test_a_cpu_job_hides_the_gpus_of_its_tasks_and_leaves_gpu_less_tasks_alone():
    from hvd_spark._internal.topology import gpu_env

    assert gpu_env(["0"], False, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert gpu_env(None, False, {}) == {}
    assert gpu_env(["0"], False, {"CUDA_VISIBLE_DEVICES": "0"}) == {}


def test_gpus_asked_for_and_none_assigned_name_the_spark_conf_keys():
    from hvd_spark._internal.topology import gpu_env

    with pytest.raises(ValueError, match=r"use_gpu=True, but Spark assigned no GPU to this barrier task") as e:
        gpu_env(None, True, {})
    for key in ("spark.task.resource.gpu.amount", "spark.executor.resource.gpu.amount", "discoveryScript"):
        assert key in str(e.value)


def test_nccl_carries_gpu_collectives_only_when_built_and_not_chosen_by_the_user():
    from hvd_spark._internal.topology import gpu_operations

    gpu = {"HVD_SPARK_GPUS": "0"}
    assert gpu_operations(True, gpu) == {"HOROVOD_GPU_OPERATIONS": "NCCL"}
    assert gpu_operations(False, gpu) == {}  # Horovod without NCCL: host copies and Gloo / MPI
    assert gpu_operations(True, {}) == {}  # a CPU rank
    assert gpu_operations(True, {**gpu, "HOROVOD_GPU_ALLREDUCE": "MPI"}) == {}


@pytest.mark.parametrize("raw,amount", [(None, 0.0), ("1", 1.0), ("0.5", 0.5)])
def test_task_gpu_amount_reads_the_spark_conf(raw, amount):
    from hvd_spark._internal.topology import task_gpu_amount

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
    pytest.importorskip("pyspark")
    from hvd_spark._internal.transformer import gpu_device

    assert gpu_device(addresses, visible) == device
