"""Issue 48: hvd_spark's ``TorchEstimator`` against a plain torch process on the same cores, and the same
training function under Spark's ``TorchDistributor`` and under ``hvd_spark.run``.

The task (the same everywhere): a Parquet table of N rows (``x``: 32 float32 as an array column, ``y``:
a class 0-9 from a fixed linear rule with noise; files of 250,000 rows, row groups of 65,536), written
once with pyarrow under a temporary folder and deleted at the end; an MLP 32-256-256-10 (76,810
parameters, ``torch.manual_seed(0)``), Adam 1e-3, cross-entropy, global batch B (default 512), one
epoch. Every job runs in a fresh process of its own (``local[2]`` for the Spark ones), timed from
outside (the whole job: Python's start, imports, session, reading, training, exit) and from inside;
the systems are alternated, ``--repeats`` times:

- ``plain``: plain torch in one process with torch's default threads (both cores): pyarrow reads the
  table, numpy -> tensors, one shuffled pass at batch B (the baseline);
- ``hvd_1rank`` / ``hvd_2ranks``: ``hvd_spark.torch.TorchEstimator`` on the table read in place,
  ``num_proc=1`` at batch B (one rank with both cores' threads) and ``num_proc=2`` at B/2 per rank
  (one thread each); training rows/s from the fit summary (the ranks' ``train_seconds``);
- ``run``: :func:`train_fn` (``init_process_group("gloo")`` from the launcher's variables, each rank
  reading its half of the table with pyarrow, DDP, B/2 per rank, one thread each) through
  ``hvd_spark.run(fn, num_proc=2)``;
- ``td_tasks`` / ``td_local``: the same function through ``pyspark.ml.torch.distributor.TorchDistributor
  (num_processes=2, use_gpu=False)`` with ``local_mode=False`` (a barrier job whose two tasks each run
  ``torchrun``, as on a cluster) and ``local_mode=True`` (``torchrun`` started by the driver).

hvd_spark's jobs run with warm ranks off (``HVD_SPARK_WARM=0``): every rank is a fresh process, as
under TorchDistributor. Recorded per run: whole job, the launcher call (``fit`` / ``run``), reading,
training (rank 0's first step to the last rank's end of training), training rows/s, the loss of the
epoch, and for the launchers the time outside the function (call to the first rank's entry, the last
rank's exit to the call's return). Ratios of medians against ``plain`` (and ``td_*`` against ``run``)
are written to ``results/vs_torch.json`` with the target (training rows/s >= 0.9x plain at 5M rows,
hvd_spark's TorchEstimator) marked met or missed.

    python -m benchmarks.bench_vs_torch [--rows N] [--repeats R] [--batch B] [--systems ...] [--quick]

``--quick``: 200,000 rows, 1 repeat (a smoke test, not the target's figures); ``--note`` keeps a sentence
(why a run's size differs from the target's, ...) in the results file.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.common import run_in_group, stats, write

FEATURES = 32
HIDDEN = 256
CLASSES = 10
PARAMS = FEATURES * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES  # 76,810
EPOCHS = 1
LR = 1e-3
BATCH = 512  # global
ROWS = 5_000_000
ROWS_PER_FILE = 250_000
ROW_GROUP = 65_536
TARGET_ROWS_PER_S = 0.9
JOB_TIMEOUT_S = 1800.0
SYSTEMS = ("plain", "hvd_1rank", "hvd_2ranks", "run", "td_tasks", "td_local")
HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


# --- the table ----------------------------------------------------------------------------------


def make_table(path: str, rows: int, seed: int = 0) -> int:
    """``rows`` rows (``x``: 32 float32, ``y``: int64 class of ``argmax(x @ W + noise)``) as Parquet
    files of ROWS_PER_FILE rows under ``path``; returns the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(12345).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    total = 0
    for k, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        n = min(ROWS_PER_FILE, rows - start)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        y = np.argmax(x @ w + 2.0 * rng.standard_normal((n, CLASSES), dtype=np.float32), axis=1).astype(np.int64)
        offsets = pa.array(np.arange(0, (n + 1) * FEATURES, FEATURES, dtype=np.int32))
        col = pa.ListArray.from_arrays(offsets, pa.array(x.ravel()))
        out = os.path.join(path, f"part-{k:05d}.parquet")
        pq.write_table(pa.table({"x": col, "y": y}), out, row_group_size=ROW_GROUP)
        total += os.path.getsize(out)
    return total


# --- what runs inside a job's process (and inside the launchers' ranks) --------------------------


def read_share(table: str, rank: int, size: int):
    """Rows ``[rank * m, (rank + 1) * m)`` of the table's ``n`` rows, ``m = n // size`` (every rank the
    same count, so that DDP's ranks make the same steps; together the first ``size * m`` rows):
    ``(x float32 (m, 32), y int64)``, read with pyarrow from the row groups that hold them only."""
    import glob

    import numpy as np
    import pyarrow.parquet as pq

    files = [pq.ParquetFile(f) for f in sorted(glob.glob(os.path.join(table, "*.parquet")))]
    n = sum(f.metadata.num_rows for f in files)
    lo = rank * (n // size)
    hi = lo + n // size
    xs, ys, at = [], [], 0
    for f in files:
        for g in range(f.metadata.num_row_groups):
            rows = f.metadata.row_group(g).num_rows
            a, b = max(lo, at), min(hi, at + rows)
            if a < b:
                t = f.read_row_group(g, columns=["x", "y"]).slice(a - at, b - a)
                xs.append(np.asarray(t.column("x").combine_chunks().flatten(), dtype=np.float32).reshape(-1, FEATURES))
                ys.append(np.asarray(t.column("y").combine_chunks(), dtype=np.int64))
            at += rows
    return np.concatenate(xs), np.concatenate(ys)


def make_net():
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    assert sum(p.numel() for p in net.parameters()) == PARAMS
    return net


def train_loop(model, x, y, batch: int, seed: int) -> dict:
    """One shuffled pass over ``(x, y)`` (tensors) at ``batch`` rows a step: Adam, cross-entropy. The
    plain loop everyone writes; ``model`` may be DDP-wrapped."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    steps = math.ceil(len(y) / batch)
    loss_sum = 0.0
    t0 = time.time()
    for s in range(steps):
        idx = order[s * batch : (s + 1) * batch]
        loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * len(idx)
    t1 = time.time()
    return {"t_train_begin": t0, "t_train_end": t1, "steps": steps, "rows": len(y), "loss": loss_sum / len(y)}


def train_fn(table: str, batch: int, threads: int, marks: str) -> dict:
    """One rank of a ``torch.distributed`` job, as one writes it for TorchDistributor or torchrun:
    ``init_process_group("gloo")`` from the launcher's variables, its half of the table, DDP. Writes
    its timestamps to ``marks/rank-<r>.json`` (TorchDistributor returns rank 0's result only)."""
    t_fn_start = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = read_share(table, rank, size)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    t_read = time.time()
    model = DistributedDataParallel(make_net())  # broadcasts rank 0's weights
    out = train_loop(model, x, y, batch, seed=rank)
    losses = torch.tensor([out["loss"] * out["rows"], float(out["rows"])], dtype=torch.float64)
    dist.all_reduce(losses)
    dist.destroy_process_group()
    out.update(
        rank=rank,
        size=size,
        threads=torch.get_num_threads(),
        t_fn_start=t_fn_start,
        t_pg=t_pg,
        t_read=t_read,
        loss=float(losses[0] / losses[1]),
        t_fn_end=time.time(),
    )
    with open(os.path.join(marks, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


def job_plain(a) -> dict:
    """Plain torch in this process, torch's default threads: read, tensors, one pass at batch B."""
    t_enter = time.time()
    import torch

    t_imported = time.time()
    x, y = read_share(a.table, 0, 1)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    t_read = time.time()
    out = train_loop(make_net(), x, y, a.batch, seed=0)
    train_s = out["t_train_end"] - out["t_train_begin"]
    return {
        "rows": out["rows"],
        "global_batch": a.batch,
        "steps": out["steps"],
        "threads": torch.get_num_threads(),
        "import_s": t_imported - t_enter,
        "read_s": t_read - t_imported,
        "train_s": train_s,
        "work_s": time.time() - t_imported,  # read + model + training: what a fit does from the data
        "train_rows_per_s": out["rows"] / train_s,
        "read_train_rows_per_s": out["rows"] / (t_read - t_imported + train_s),  # reading counted as training
        "final_loss": out["loss"],
    }


def _session(app: str):
    import hvd_spark

    spark = hvd_spark.local_session("local[2]", app_name=app)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def job_hvd(a) -> dict:
    """``TorchEstimator.fit`` on the table read in place: ``num_proc`` ranks at B / ``num_proc`` each."""
    t_enter = time.time()
    import torch

    from hvd_spark.torch import TorchEstimator

    t_imported = time.time()
    spark = _session("hvd_spark-bench-vs-torch")
    t_session = time.time()
    store = tempfile.mkdtemp(prefix="vs_torch-store-")
    net = make_net()
    per_rank = a.batch // a.num_proc
    est = TorchEstimator(
        num_proc=a.num_proc,
        store=store,
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=LR),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=per_rank,
        epochs=EPOCHS,
        random_seed=0,
        verbose=0,
    )
    t0 = time.time()
    model = est.fit(spark.read.parquet(a.table))
    fit_s = time.time() - t0
    s = model.getFitSummary()
    ranks = len(s.ranks)
    rows = min(s.steps_per_epoch * ranks * per_rank, a.rows)  # whole batches: the last one may be short
    train_s = max(r.train_seconds or 0.0 for r in s.ranks)
    hist = model.getHistory()
    spark.stop()
    shutil.rmtree(store, ignore_errors=True)
    return {
        "ranks": ranks,
        "batch_per_rank": per_rank,
        "global_batch": per_rank * ranks,
        "steps": s.steps_per_epoch,
        "rows": rows,
        "import_s": t_imported - t_enter,
        "session_s": t_session - t_imported,
        "fit_s": fit_s,
        "work_s": fit_s,
        "materialize_s": s.materialize_seconds,
        "train_job_s": s.train_job_seconds,
        "train_s": train_s,
        "train_s_per_rank": {str(r.rank): r.train_seconds for r in s.ranks},
        "train_rows_per_s": rows / train_s,
        "read_train_rows_per_s": rows / train_s,  # the ranks read the table while they train
        "outside_training_s": fit_s - train_s,
        "final_loss": float(hist["loss"][-1]) if hist.get("loss") else None,
        "startup": {str(r.rank): r.startup for r in s.ranks},
    }


def _launcher_result(a, t_call: float, t_return: float, marks: str) -> dict:
    """The ranks' marks, as figures: training = the earliest first step to the last end of training."""
    ranks = []
    for name in sorted(os.listdir(marks)):
        with open(os.path.join(marks, name)) as f:
            ranks.append(json.load(f))
    if len(ranks) != a.num_proc:
        raise RuntimeError(f"{len(ranks)} of {a.num_proc} ranks wrote their marks in {marks}")
    train_s = max(r["t_train_end"] for r in ranks) - min(r["t_train_begin"] for r in ranks)
    read_s = max(r["t_read"] - r["t_pg"] for r in ranks)
    rows = sum(r["rows"] for r in ranks)
    to_fn = min(r["t_fn_start"] for r in ranks) - t_call
    after_fn = t_return - max(r["t_fn_end"] for r in ranks)
    return {
        "ranks": len(ranks),
        "batch_per_rank": a.batch // a.num_proc,
        "global_batch": a.batch,
        "steps": ranks[0]["steps"],
        "rows": rows,
        "threads_per_rank": [r["threads"] for r in ranks],
        "job_s": t_return - t_call,
        "work_s": t_return - t_call,
        "to_fn_s": to_fn,  # the launcher call to the first rank entering the function
        "fn_to_pg_s": max(r["t_pg"] - r["t_fn_start"] for r in ranks),  # torch import + the rendezvous
        "read_s": read_s,
        "train_s": train_s,
        "train_rows_per_s": rows / train_s,
        "read_train_rows_per_s": rows / (read_s + train_s),
        "after_fn_s": after_fn,  # the last rank leaving the function to the call returning
        "launcher_overhead_s": to_fn + after_fn,
        "final_loss": ranks[0]["loss"],
    }


def job_run(a) -> dict:
    """:func:`train_fn` through ``hvd_spark.run`` (2 ranks, fresh processes, one thread each)."""
    t_enter = time.time()
    import hvd_spark

    t_imported = time.time()
    spark = _session("hvd_spark-bench-vs-torch-run")
    t_session = time.time()
    marks = tempfile.mkdtemp(prefix="vs_torch-marks-")
    args = (a.table, a.batch // a.num_proc, 1, marks)
    t_call = time.time()
    hvd_spark.run(train_fn, args=args, num_proc=a.num_proc, spark=spark, verbose=0, warm=False, timeout=JOB_TIMEOUT_S)
    t_return = time.time()
    out = _launcher_result(a, t_call, t_return, marks)
    spark.stop()
    shutil.rmtree(marks, ignore_errors=True)
    return dict(out, import_s=t_imported - t_enter, session_s=t_session - t_imported)


def job_td(a) -> dict:
    """:func:`train_fn` through ``TorchDistributor(num_processes=2, local_mode=..., use_gpu=False)`` on a
    plain ``local[2]`` session with hvd_spark's settings (loopback, no UI); hvd_spark is not imported."""
    t_enter = time.time()
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    t_imported = time.time()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # as hvd_spark.local_session does
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-vs-torch-torch-distributor")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    t_session = time.time()
    marks = tempfile.mkdtemp(prefix="vs_torch-marks-")
    local = a.job == "td_local"
    distributor = TorchDistributor(num_processes=a.num_proc, local_mode=local, use_gpu=False)
    t_call = time.time()
    distributor.run(train_fn, a.table, a.batch // a.num_proc, 1, marks)
    t_return = time.time()
    out = _launcher_result(a, t_call, t_return, marks)
    spark.stop()
    shutil.rmtree(marks, ignore_errors=True)
    return dict(out, local_mode=local, import_s=t_imported - t_enter, session_s=t_session - t_imported)


JOBS = {"plain": job_plain, "hvd": job_hvd, "run": job_run, "td_tasks": job_td, "td_local": job_td}


# --- the parent: every job in its own process -----------------------------------------------------


def run_job(job: str, table: str, rows: int, batch: int, num_proc: int) -> dict:
    """One job in a fresh process (its own session and process group): its result, with the whole
    job's wall time seen from here."""
    cmd = [sys.executable, "-m", "benchmarks.bench_vs_torch", "--job", job, "--table", table]
    cmd += ["--rows", str(rows), "--batch", str(batch), "--num-proc", str(num_proc)]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), HVD_SPARK_WARM="0", SPARK_LOCAL_IP="127.0.0.1")
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch's defaults in the plain process
        env.pop(k, None)
    out, err, returncode, whole = run_in_group(cmd, env, JOB_TIMEOUT_S)
    found = [line for line in out.splitlines() if line.startswith("{")]
    if not found:
        tail = "\n".join((err or "").strip().splitlines()[-12:])
        return {
            "outcome": "failed",
            "error": f"no result (exit {returncode}); stderr tail:\n{tail}",
            "whole_s": whole,
        }
    return dict(json.loads(found[-1]), outcome="ok", whole_s=whole)


def _job_of(system: str) -> tuple[str, int]:
    return {
        "plain": ("plain", 1),
        "hvd_1rank": ("hvd", 1),
        "hvd_2ranks": ("hvd", 2),
        "run": ("run", 2),
        "td_tasks": ("td_tasks", 2),
        "td_local": ("td_local", 2),
    }[system]


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get("outcome") == "ok" and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


KEYS = (
    "whole_s",
    "work_s",
    "read_s",
    "train_s",
    "train_rows_per_s",
    "read_train_rows_per_s",
    "final_loss",
    "outside_training_s",
    "launcher_overhead_s",
    "to_fn_s",
    "fn_to_pg_s",
    "after_fn_s",
)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per system and the ratios: against plain torch, and each TorchDistributor mode against
    ``hvd_spark.run`` (the same function, the launcher's own cost)."""
    medians = {}
    for s, rs in runs.items():
        ok = [r for r in rs if r.get("outcome") == "ok"]
        medians[s] = {"runs_ok": len(ok), "runs": len(rs)}
        for k in KEYS:
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                medians[s][k] = stats(vals)
    ratios: dict = {}
    for s in runs:
        if s == "plain":
            continue
        ratios[s] = {
            "train_rows_per_s_over_plain": _ratio(
                _median(runs[s], "train_rows_per_s"), _median(runs.get("plain", []), "train_rows_per_s")
            ),
            "read_train_rows_per_s_over_plain": _ratio(
                _median(runs[s], "read_train_rows_per_s"), _median(runs.get("plain", []), "read_train_rows_per_s")
            ),
            "whole_over_plain": _ratio(_median(runs[s], "whole_s"), _median(runs.get("plain", []), "whole_s")),
            "work_over_plain": _ratio(_median(runs[s], "work_s"), _median(runs.get("plain", []), "work_s")),
        }
        if s.startswith("td_") and "run" in runs:
            for k in ("whole_s", "work_s", "launcher_overhead_s", "train_rows_per_s"):
                ratios[s][f"{k}_over_run"] = _ratio(_median(runs[s], k), _median(runs["run"], k))
    return {"medians": medians, "ratios": ratios}


def targets(out: dict) -> list[dict]:
    res = []
    for s in ("hvd_1rank", "hvd_2ranks"):
        value = (out["ratios"].get(s) or {}).get("train_rows_per_s_over_plain")
        if s not in out["ratios"]:
            continue
        note = "" if out["rows"] >= ROWS else f"run at {out['rows']:,} rows, not the target's {ROWS:,}"
        res.append(
            {
                "target": f"training rows/s, {s} / plain torch",
                "value": value,
                "limit": TARGET_ROWS_PER_S,
                "at_most": False,
                "met": None if value is None else value >= TARGET_ROWS_PER_S,
                "note": note,
            }
        )
    return res


def main(rows: int, repeats: int, batch: int, systems: tuple[str, ...], note: str = "", quick: bool = False) -> dict:
    systems = ("plain", *[s for s in systems if s != "plain"])
    t_all = time.time()
    tmp = tempfile.mkdtemp(prefix="vs_torch-")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        table = os.path.join(tmp, "table")
        t0 = time.time()
        size = make_table(table, rows)
        table_s = time.time() - t0
        print(f"table of {rows:,} rows: {size / MIB:.0f} MiB in {table_s:.0f} s", flush=True)
        for rep in range(repeats):
            for s in systems:
                job, n = _job_of(s)
                r = run_job(job, table, rows, batch, n)
                runs[s].append(r)
                brief = {k: r.get(k) for k in ("outcome", "whole_s", "work_s", "train_s", "train_rows_per_s")}
                print(f"  repeat {rep + 1} {s}: {json.dumps(brief)}", flush=True)
                if r.get("outcome") != "ok":
                    print(f"    error: {r.get('error')}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict = {
        "what": (
            f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} ({PARAMS:,} params), Adam {LR:g}, cross-entropy, "
            f"{EPOCHS} epoch at a global batch of {batch}, a Parquet table of {rows:,} rows ({FEATURES}-float array, "
            "a class 0-9; "
            f"files of {ROWS_PER_FILE:,} rows, row groups of {ROW_GROUP:,}); plain torch in a fresh process (pyarrow "
            "read, torch's default threads) against TorchEstimator read in place (1 rank x B with both cores' "
            "threads, 2 ranks x B/2 with one thread each) and one torch.distributed function (DDP over Gloo, 2 ranks "
            "x B/2, one thread each, each rank reading its half with pyarrow) under hvd_spark.run and "
            "TorchDistributor; each job a fresh process on local[2], warm ranks off, timed from outside (whole job) "
            "and inside"
        ),
        "rows": rows,
        "quick": quick,
        "global_batch": batch,
        "repeats": repeats,
        "systems": list(systems),
        "table_bytes": size,
        "table_write_s": table_s,
        "cpus": os.cpu_count(),
        "note": note,
        "runs": runs,
    }
    out.update(summarize(runs))
    out["targets"] = targets(out)
    out["wall_s"] = time.time() - t_all
    for t in out["targets"]:
        print(f"target {t['target']}: {t['value']} (>= {t['limit']}): {t['met']}")
    print(json.dumps(out["ratios"], indent=1))
    path = write("vs_torch", out)
    print(f"wrote {path}")
    return out


def _job_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=tuple(JOBS), required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--num-proc", type=int, default=1)
    a = p.parse_args(argv)
    result = JOBS[a.job](a)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if "--job" in sys.argv:
        _job_main(sys.argv[1:])
    else:
        p = argparse.ArgumentParser()
        p.add_argument("--rows", type=int, default=ROWS, help=f"rows of the table (default {ROWS:,})")
        p.add_argument("--repeats", type=int, default=2, help="runs of each job, alternated (default 2)")
        p.add_argument("--batch", type=int, default=BATCH, help=f"the global batch (default {BATCH})")
        p.add_argument("--systems", nargs="+", choices=SYSTEMS[1:], default=list(SYSTEMS[1:]), help="besides plain")
        p.add_argument("--note", default="", help="a sentence kept in the results (why this size, ...)")
        p.add_argument("--quick", action="store_true", help="200,000 rows, 1 repeat (a smoke test)")
        args = p.parse_args()
        if args.quick:
            args.rows, args.repeats = 200_000, 1
        main(args.rows, args.repeats, args.batch, tuple(args.systems), args.note, args.quick)
