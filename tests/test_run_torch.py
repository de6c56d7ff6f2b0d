"""hvd_spark.run with functions written for torch.distributed (TorchDistributor, torchrun): real Spark
(local[2]), real rank processes, warm (forked from a server that imported TensorFlow) and cold.

What must hold: ``dist.init_process_group("gloo")`` joins the job from the variables the tasks set
(rank 0's address and its task's reserved port), the ranks' collectives are exact, a DDP step on two
ranks equals one step on their concatenated batches, and a function that never destroys its process
group still ends."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: hvd_spark.run's torch.distributed support")

from _helpers import horovod_mpi_built  # noqa: E402

import hvd_spark  # noqa: E402

TORCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "GLOO_SOCKET_IFNAME",
)
LR = 0.1
SEED = 7


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _start_weights():
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(1, 3, generator=g, dtype=torch.float32), torch.randn(1, generator=g, dtype=torch.float32)


def _batches():
    """Each rank's own batch (rank r trains on xs[r], ys[r]): different data per rank."""
    rng = np.random.default_rng(SEED)
    xs = rng.normal(size=(2, 5, 3)).astype("float32")
    ys = rng.normal(size=(2, 5, 1)).astype("float32")
    return xs, ys


def ddp_step(xs, ys, weight, bias, lr):
    """As one writes it for TorchDistributor: env:// from the launcher's variables, Gloo, DDP."""
    preloaded = "tensorflow" in sys.modules  # a warm rank's server imported TF before the fork
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    env = {name: os.environ.get(name) for name in TORCH_VARS}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    summed = torch.tensor([rank + 1.0, 1000.0 * (rank + 1), 2.0**-20 * (rank + 3)], dtype=torch.float64)
    dist.all_reduce(summed)  # SUM
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    x, y = torch.from_numpy(xs[rank]), torch.from_numpy(ys[rank])
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # DDP averages the gradients over the ranks
    opt.step()
    out = {
        "rank": rank,
        "world": world,
        "sum": summed.tolist(),
        "weight": model.weight.detach().numpy().tolist(),
        "bias": model.bias.detach().numpy().tolist(),
        "env": env,
        "preloaded": preloaded,
        "warm": os.environ.get("HVD_SPARK_WARM_RANK") == "1",
        "threads": (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")),
    }
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_torch_distributed_function_runs_unchanged(spark, warm):
    xs, ys = _batches()
    weight, bias = _start_weights()
    args = (xs, ys, weight, bias, LR)
    # warm: the ranks are forked by the host's warm server (the first warm job starts it), which
    # imported TensorFlow, Keras and Horovod before the fork.
    results = hvd_spark.run(ddp_step, args=args, num_proc=2, spark=spark, verbose=0, warm=warm, timeout=600)
    _check_ddp_step(results, xs, ys, weight, bias, warm)
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in results] == ["lo", "lo"]  # the task's interface


@pytest.mark.mpi
@pytest.mark.skipif(not horovod_mpi_built(), reason="Horovod built without MPI (no OpenMPI on this machine)")
def test_a_torch_distributed_function_runs_under_mpirun(spark):
    """backend="mpi": mpirun's ranks derive the same variables from their MPI rank and rank 0's task's
    exports (task/mpi.py), so the same function runs."""
    xs, ys = _batches()
    weight, bias = _start_weights()
    args = (xs, ys, weight, bias, LR)
    results = hvd_spark.run(ddp_step, args=args, num_proc=2, spark=spark, verbose=0, use_mpi=True, timeout=600)
    _check_ddp_step(results, xs, ys, weight, bias, warm=False)


def _check_ddp_step(results, xs, ys, weight, bias, warm):
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["world"] for r in results] == [2, 2]
    assert [r["warm"] for r in results] == [warm, warm]
    assert [r["preloaded"] for r in results] == [warm, warm]  # a warm rank imported torch after TF: it works
    for r in results:  # torch's intra-op threads are the rank's share (OMP_NUM_THREADS), forked or not
        assert r["threads"][0] == int(r["threads"][1])
    for r in results:  # exact: 1+2, 1000+2000, 2^-20 * (3+4)
        assert r["sum"] == [3.0, 3000.0, 7 * 2.0**-20]
    # torchrun's variables: one host (a node), two local ranks on it, rank 0's task's port for both.
    envs = [r["env"] for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["GROUP_RANK"]) == ("2", "2", "0", "0")
        assert (e["GROUP_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("1", "2")
        assert e["MASTER_ADDR"] == "127.0.0.1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    assert envs[0]["TORCHELASTIC_RUN_ID"] == envs[1]["TORCHELASTIC_RUN_ID"]
    assert envs[0]["TORCHELASTIC_RUN_ID"].startswith("hvd_spark-")

    # Both ranks hold the same weights, and they are one SGD step on the two batches together.
    assert results[0]["weight"] == results[1]["weight"] and results[0]["bias"] == results[1]["bias"]
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.from_numpy(np.concatenate(list(xs)))
    y = torch.from_numpy(np.concatenate(list(ys)))
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    np.testing.assert_allclose(results[0]["weight"], model.weight.detach().numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(results[0]["bias"], model.bias.detach().numpy(), rtol=0, atol=1e-6)
    assert not np.allclose(results[0]["weight"], weight.numpy(), atol=1e-3)  # the step moved the weights


ROWS, BATCH, EPOCHS = 24, 4, 2


def _dataset():
    rng = np.random.default_rng(SEED + 1)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    y = (x @ np.array([[1.5], [-2.0], [0.5]], dtype="float32") + 0.25).astype("float32")
    return x, y


def distributor_train(x, y, weight, bias, learning_rate, use_gpu):
    """pyspark's TorchDistributor example (its docstring's ``train``), filled in: backend and device
    from use_gpu and LOCAL_RANK, DDP, a DistributedSampler's DataLoader; no destroy_process_group."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    backend = "nccl" if use_gpu else "gloo"
    dist.init_process_group(backend)
    device = int(os.environ["LOCAL_RANK"]) if use_gpu else "cpu"
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    model = DDP(model.to(device))
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler, batch_size=BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
    # The example ends with a cleanup; this one forgets it: the rank must still end (rank/entry.py).
    return {
        "weight": model.module.weight.detach().cpu().numpy().tolist(),
        "bias": model.module.bias.detach().cpu().numpy().tolist(),
        "initialized": dist.is_initialized(),
    }


def _reference(x, y, weight, bias):
    """The same training in one process: each step on both ranks' sampler batches together."""
    from torch.utils.data import DistributedSampler, TensorDataset

    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=r) for r in (0, 1)]
    for epoch in range(EPOCHS):
        order = []
        for s in samplers:
            s.set_epoch(epoch)
            order.append(list(s))
        for step in range(0, len(order[0]), BATCH):
            idx = order[0][step : step + BATCH] + order[1][step : step + BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])).backward()
            opt.step()
    return model.weight.detach().numpy(), model.bias.detach().numpy()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_pysparks_torch_distributor_example_runs_through_run(spark, warm):
    x, y = _dataset()
    weight, bias = _start_weights()
    # TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(distributor_train, ...)
    results = hvd_spark.run(
        distributor_train,
        args=(x, y, weight, bias, LR, False),
        num_proc=2,
        spark=spark,
        verbose=0,
        warm=warm,
        timeout=600,
    )
    assert len(results) == 2
    assert all(r["initialized"] for r in results)  # left for hvd_spark to destroy; the job ended all the same
    assert results[0]["weight"] == results[1]["weight"] and results[0]["bias"] == results[1]["bias"]
    ref_w, ref_b = _reference(x, y, weight, bias)
    np.testing.assert_allclose(results[0]["weight"], ref_w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(results[0]["bias"], ref_b, rtol=0, atol=1e-6)
    assert not np.allclose(ref_w, weight.numpy(), atol=1e-2)  # it trained


def one_rank_fails_in_a_collective():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed before its all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for rank 1, which never comes: Gloo alone would wait 30 minutes
    return t.item()


def test_a_failed_rank_stops_its_peer_waiting_in_a_torch_collective(spark):
    """The job's abort stops a rank blocked in a torch collective (the failed rank is named, the job
    does not run into its timeout)."""
    with pytest.raises(hvd_spark.RankFailedError, match="rank 1 failed before its all_reduce") as info:
        hvd_spark.run(one_rank_fails_in_a_collective, num_proc=2, spark=spark, verbose=0, timeout=300)
    assert info.value.rank == 1
    assert not isinstance(info.value, hvd_spark.JobTimeoutError)


def fabric_all_reduce():
    import lightning as L
    import torch

    # The layout from the variables: a host is a node (under TorchDistributor: devices=1, num_nodes=N).
    fabric = L.Fabric(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        strategy="ddp",
    )
    fabric.launch()
    summed = fabric.all_reduce(torch.tensor([fabric.global_rank + 1.0]), reduce_op="sum")
    environment = type(fabric._connector.cluster_environment).__name__
    return fabric.global_rank, fabric.world_size, fabric.node_rank, fabric.local_rank, environment, summed.tolist()


def test_lightning_takes_the_variables_as_under_torchrun(spark):
    """TORCHELASTIC_RUN_ID makes Lightning pick its TorchElasticEnvironment: it starts no processes of
    its own and reads the ranks from the variables."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    results = hvd_spark.run(fabric_all_reduce, num_proc=2, spark=spark, verbose=0, warm=False, timeout=600)
    assert results == [(0, 2, 0, 0, "TorchElasticEnvironment", [3.0]), (1, 2, 0, 1, "TorchElasticEnvironment", [3.0])]
