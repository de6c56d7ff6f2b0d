"""Baseline for issue 28's overhead table: Spark's TorchDistributor (pyspark.ml.torch.distributor).

Run it with the `torch` venv of benchmarks/baselines/setup.sh (pyspark 4.3, CPU torch); prints ONE
JSON line on stdout at the end, everything else goes to stderr.

    python torch_distributor.py [--kill-after-epoch K] [--timeout 180] [--local-mode]

`TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train)` on a `local[2]`
session. local_mode=False is the mode that trains in Spark tasks: a barrier job (mapInArrow with
barrier=True) of 2 tasks, each task's Python worker runs `torchrun --nnodes=2 --node_rank=<task>
--nproc_per_node=1` (rendezvous at task 0's address), i.e. one training process per Spark task,
as on a cluster. local_mode=True (`--local-mode`, for comparison) runs no Spark job at all:
the driver itself starts `torchrun --standalone --nproc_per_node=2`, two training processes that are
children of the driver, and Spark only supplies the configuration.

The task (the same in every baseline): sklearn load_digits, all 1,797 rows, X/16 as float32 (64
features), int labels 0-9; MLP Linear(64, 64) -> ReLU -> Linear(64, 10) (softmax inside
CrossEntropyLoss); Adam with learning rate 1e-3, NOT scaled by the world size (the same in every
baseline); torch.distributed over gloo with DistributedDataParallel; 2 ranks, batch 32 per rank,
each rank trains on rows rank::2 (899 and 898 rows: 29 steps per epoch on both), reshuffled each
epoch; 10 epochs; torch.set_num_threads(1) and set_num_interop_threads(1) per rank; CPU only.

Timestamps (time.time(), seconds since the epoch): t_script_start (first line of this file),
t_spark_ready (session up), t_run_begin (TorchDistributor.run called), t_first_step (rank 0, before
the first forward), t_train_begin / t_train_end (rank 0, around the 10-epoch loop), t_end (when
run returned in the driver). `accuracy`: rank 0's trained model on all 1,797 rows. There is no
transform / predict step in TorchDistributor, so no t_predict_*. Also: t_rank_proc_start /
t_fn_start / t_pg_ready (rank 0's process started, train() entered, process group ready), t_kill,
t_json, error_detail; check: weights_max_abs_diff_between_ranks (0.0: gradients were averaged).

--kill-after-epoch K: when epoch K (1-based) has ended, rank 1 SIGKILLs itself (a lost rank; it
first writes t_kill to a file). Recovery TorchDistributor offers: none. It does not expose
torchrun's --max-restarts (so torchrun's own restart is 0), the Spark barrier stage fails as a
whole and is not retried in local mode (one attempt per task), and run() raises; the user reruns it.
The JSON then says outcome "failed" with the error's first line; "hung" when the watchdog (--timeout)
fired first, in which case this script kills its own child processes (JVM, workers, torchrun) by pid.
"""

import time

T_SCRIPT_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

from _harness import (  # noqa: E402  (also: stdout is the result line's)
    compare_rank_weights,
    detail,
    emit,
    first_line,
    proc_start_time,
    ship_by_value,
    start_watchdog,
)

ship_by_value()

os.environ.update(
    OMP_NUM_THREADS="1",
    CUDA_VISIBLE_DEVICES="",
    PYSPARK_PYTHON=sys.executable,
    PYSPARK_DRIVER_PYTHON=sys.executable,
    SPARK_LOCAL_IP="127.0.0.1",
    PYARROW_IGNORE_TIMEZONE="1",
)

EPOCHS, BATCH, NUM_PROC, LR = 10, 32, 2, 1e-3


def train(work_dir: str, kill_after_epoch):
    """One rank, started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    t_fn_start = time.time()
    import numpy as np
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo")
    t_pg_ready = time.time()
    rank, size = dist.get_rank(), dist.get_world_size()
    digits = load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    Xr, yr = X[rank::size], y[rank::size]
    steps = (len(Xr) + BATCH - 1) // BATCH

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = DDP(net)  # broadcasts rank 0's initial parameters
    # Learning rate 1e-3, deliberately not multiplied by the world size (the same in every baseline).
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + rank)

    # Where rank 0's start-up went: process started, train() entered (torch imported by the
    # wrapper script), process group ready.
    times = {"t_rank_proc_start": proc_start_time(), "t_fn_start": t_fn_start, "t_pg_ready": t_pg_ready}

    def save_times():
        if rank == 0:  # kept on disk too, for a run that fails later
            with open(os.path.join(work_dir, "rank0_times.json"), "w") as f:
                json.dump(times, f)

    times["t_train_begin"] = time.time()
    for epoch in range(EPOCHS):
        order = torch.randperm(len(Xr), generator=gen)
        for step in range(steps):
            idx = order[step * BATCH : (step + 1) * BATCH]
            if epoch == 0 and step == 0:
                times["t_first_step"] = time.time()
                save_times()
            opt.zero_grad()
            loss = loss_fn(model(Xr[idx]), yr[idx])
            loss.backward()
            opt.step()
        if kill_after_epoch is not None and epoch + 1 == kill_after_epoch and rank == 1:
            with open(os.path.join(work_dir, "rank1_kill.json"), "w") as f:
                json.dump({"t_kill": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
    times["t_train_end"] = time.time()
    save_times()
    # Every rank's final weights, compared by the driver: identical when gradients were averaged.
    np.savez(os.path.join(work_dir, f"weights_rank{rank}.npz"), *[p.detach().numpy() for p in net.parameters()])
    out = dict(times, rank=rank, steps_per_epoch=steps)
    if rank == 0:
        with torch.no_grad():
            out["accuracy"] = float((net(X).argmax(dim=1) == y).float().mean())
    dist.destroy_process_group()
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill-after-epoch", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=180.0, help="watchdog: outcome 'hung' after this many seconds")
    ap.add_argument(
        "--local-mode", action="store_true", help="TorchDistributor(local_mode=True): torchrun on the driver"
    )
    args = ap.parse_args()
    result = {
        "system": "pyspark.ml.torch.distributor.TorchDistributor",
        "local_mode": args.local_mode,
        "t_script_start": T_SCRIPT_START,
        "kill_after_epoch": args.kill_after_epoch,
        "num_proc": NUM_PROC,
        "epochs": EPOCHS,
        "batch_size_per_rank": BATCH,
    }
    work = tempfile.mkdtemp(prefix="torch_distributor_baseline_")
    start_watchdog(args.timeout, result, work)
    spark = None
    try:
        from pyspark.ml.torch.distributor import TorchDistributor
        from pyspark.sql import SparkSession

        # The same session settings as hvd_spark.local_session (benchmarks use it): loopback, no UI.
        spark = (
            SparkSession.builder.master(f"local[{NUM_PROC}]")
            .appName("baseline-torch-distributor")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.python.worker.reuse", "true")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        result["t_spark_ready"] = time.time()
        distributor = TorchDistributor(num_processes=NUM_PROC, local_mode=args.local_mode, use_gpu=False)
        result["t_run_begin"] = time.time()
        try:
            rank0 = distributor.run(train, work, args.kill_after_epoch)
        finally:
            result["t_end"] = time.time()
        result.update({k: v for k, v in rank0.items() if k != "rank"})
        result.update(compare_rank_weights(work, NUM_PROC))
        result["outcome"] = "finished"
    except Exception as exc:
        result.update(outcome="failed", error=first_line(exc), error_detail=detail(exc))
        result.setdefault("t_end", time.time())
        traceback.print_exc()
        for name in ("rank0_times.json", "rank1_kill.json"):
            path = os.path.join(work, name)
            if os.path.exists(path):
                with open(path) as f:
                    result.update(json.load(f))
    finally:
        from importlib.metadata import version

        result["versions"] = {p: version(p) for p in ("torch", "pyspark", "numpy", "pyarrow")}
        shutil.rmtree(work, ignore_errors=True)
        result["t_json"] = time.time()
        emit(result)
        if spark is not None:
            try:
                spark.stop()
            except Exception:
                traceback.print_exc()
    return result


if __name__ == "__main__":
    outcome = main().get("outcome")
    sys.stderr.flush()
    os._exit(0 if outcome == "finished" else 1)
