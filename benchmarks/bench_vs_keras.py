"""Issue 38: hvd_spark against plain Keras on the same cores, the same rows and the same steps.

The protocol (issue 38): a Parquet table of N rows (a 32-float array feature ``x`` and a binary
label ``y``, written with pyarrow under a temporary folder, reused by every run of the same N and
deleted at the end); an MLP 32-256-256-1 (74,497 parameters); Adam; binary cross-entropy; 2 epochs.
For each N in (1M, 5M) and B in (512, 64), alternated in one run, each system in a fresh process
of its own, timed from outside (the whole job: Python's start, imports, session, reading, fit,
shutdown) and from inside:

- ``plain``: plain Keras in one process reading the same files with pyarrow and fitting at batch
  2B with TensorFlow's default threads (the baseline);
- ``hvd_2ranks``: hvd_spark reading the table in place, ``num_proc=2``, batch B per rank (one rank
  per core);
- ``hvd_default``: hvd_spark's default layout (no ``num_proc``), batch 2B / ranks, ranks as the
  fit summary reports them (a run whose guess was wrong is run again with the reported count);
  both hvd_spark layouts make the same steps as plain Keras.

Recorded per run: whole job, fit, training rows/s (rows trained / time inside ``model.fit``),
per-step ms (epoch 2's time / its steps), the final loss, the tail (rank 0's last ``on_epoch_end``
to ``fit`` returning in the driver; to the driver's "N ranks finished" line; to each rank leaving
its training), and the peak RSS (VmHWM) of every process: the plain process; the driver's Python,
its JVM and each rank for hvd_spark.

The memory run: a 20M-row table (and 40M when the 20M jobs took under 7.5 min, so that the 40M
ones stay under ~15 min) copied (``materialize="always"``) and read in place, 1 epoch at batch
8192 per rank, 2 ranks, on the default ``local_session``; its peak RSS against the same run at 1M
rows (target: flat in N, a rank's at the largest N within 1.2x of 1M's).

Targets (ratios in this run, medians): whole job at 5M <= 1.3x plain Keras at B=512 and <= 1.6x at
B=64; training rows/s >= 0.8x plain; tail <= 0.5 s in every run; memory flat. Each is marked met
or missed in ``results/vs_keras.json``.

    python -m benchmarks.bench_vs_keras [--quick]

``--quick``: 200k rows, B in (512, 64), 1 repeat; the memory run at 200k and 1M rows (a smoke
test of a few minutes, not the protocol's figures). ``--part grid|memory`` runs one part (the
other kept from the results file), ``--sizes`` other row counts, ``--systems`` some of the hvd_spark
layouts (``hvd_default``, ``hvd_2ranks``), ``--repeats`` another count; the results file says which.
"""

import argparse
import contextlib
import glob
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.common import RESULTS, run_in_group, stats, write

FEATURES = 32
HIDDEN = 256
PARAMS = FEATURES * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN + 1  # 74,497
EPOCHS = 2
ROWS_PER_FILE = 250_000
ROW_GROUP = 65_536
MEM_BATCH = 8192  # per rank, the memory run
TAIL_LIMIT_S = 0.5
JOB_TIMEOUT_S = 3600.0
SYSTEMS = ("plain", "hvd_2ranks", "hvd_default")
HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


# --- the table ----------------------------------------------------------------------------------


def make_table(path: str, rows: int, seed: int = 0) -> int:
    """Writes ``rows`` rows (``x``: 32 float32, ``y``: 0/1 from a fixed linear rule) as Parquet files
    of ROWS_PER_FILE rows under ``path``; returns the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(12345).standard_normal(FEATURES).astype(np.float32)
    for k, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        n = min(ROWS_PER_FILE, rows - start)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        y = ((x @ w + 0.5 * rng.standard_normal(n, dtype=np.float32)) > 0).astype(np.float32)
        offsets = pa.array(np.arange(0, (n + 1) * FEATURES, FEATURES, dtype=np.int32))
        col = pa.ListArray.from_arrays(offsets, pa.array(x.ravel()))
        pq.write_table(
            pa.table({"x": col, "y": y}), os.path.join(path, f"part-{k:05d}.parquet"), row_group_size=ROW_GROUP
        )
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.parquet")))


# --- what runs inside a job's process ------------------------------------------------------------


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak resident set size of a process (VmHWM, bytes), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _model():
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((FEATURES,), name="x")
    z = keras.layers.Dense(HIDDEN, activation="relu")(inp)
    z = keras.layers.Dense(HIDDEN, activation="relu")(z)
    model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(z))
    assert model.count_params() == PARAMS, model.count_params()
    return model


def _marks_callback(folder: str, who: str | None = None):
    """A Keras callback writing, in ``folder/<who>.json`` (``who``: ``rank-<r>`` on a rank), the wall
    time of train begin and end and of every epoch's begin and end, and the process's VmHWM and pid
    at train end. Defined here so that it pickles by value from the job's ``__main__``."""
    import keras

    class Marks(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rec: dict = {"epoch_begin": [], "epoch_end": [], "loss": []}

        def _save(self):
            name = who or f"rank-{os.environ.get('HVD_SPARK_RANK', '0')}"
            tmp = os.path.join(folder, f".{name}.json.tmp")
            with open(tmp, "w") as f:
                json.dump(self.rec, f)
            os.replace(tmp, os.path.join(folder, f"{name}.json"))

        def on_train_begin(self, logs=None):
            self.rec.update(train_begin=time.time(), pid=os.getpid())
            self._save()

        def on_epoch_begin(self, epoch, logs=None):
            self.rec["epoch_begin"].append(time.time())

        def on_epoch_end(self, epoch, logs=None):
            self.rec["epoch_end"].append(time.time())
            self.rec["loss"].append(float((logs or {}).get("loss", float("nan"))))
            self._save()

        def on_train_end(self, logs=None):
            self.rec.update(train_end=time.time(), vm_hwm=vm_hwm())
            self._save()

    return Marks()


def _read(folder: str, name: str) -> dict:
    with open(os.path.join(folder, f"{name}.json")) as f:
        return json.load(f)


def _step_ms(marks: dict, steps: int) -> float | None:
    """Epoch 2's time per step (the first epoch traces the step); epoch 1's with one epoch."""
    b, e = marks.get("epoch_begin") or [], marks.get("epoch_end") or []
    k = 1 if len(b) > 1 and len(e) > 1 else 0
    if not b or not e or steps <= 0:
        return None
    return (e[k] - b[k]) / steps * 1000.0


def job_plain(a) -> dict:
    """Plain Keras in this process: pyarrow reads the table, ``model.fit`` at batch ``a.batch``."""
    t_enter = time.time()
    import keras  # noqa: F401 - TensorFlow's import, timed here (import_s)
    import numpy as np
    import pyarrow.parquet as pq

    t_imported = time.time()
    table = pq.read_table(a.table, columns=["x", "y"])
    x = np.asarray(table.column("x").combine_chunks().flatten(), dtype=np.float32).reshape(-1, FEATURES)
    y = np.asarray(table.column("y").combine_chunks(), dtype=np.float32)
    del table
    t_read = time.time()
    model = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy")
    marks = _marks_callback(a.marks, "plain")
    t0 = time.time()
    hist = model.fit(x, y, batch_size=a.batch, epochs=a.epochs, verbose=0, shuffle=True, callbacks=[marks])
    fit_s = time.time() - t0
    m = _read(a.marks, "plain")
    steps = math.ceil(len(y) / a.batch)
    return {
        "rows": len(y),
        "global_batch": a.batch,
        "steps_per_epoch": steps,
        "import_s": t_imported - t_enter,
        "read_s": t_read - t_imported,
        "fit_s": fit_s,
        "train_s": m["train_end"] - m["train_begin"],
        "train_rows_per_s": len(y) * a.epochs / (m["train_end"] - m["train_begin"]),
        "step_ms": _step_ms(m, steps),
        "final_loss": float(hist.history["loss"][-1]),
        "peak_rss": {"process": vm_hwm()},
    }


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record):
        with contextlib.suppress(Exception):
            self.records.append((record.created, record.getMessage()))


def _jvm_pid() -> int | None:
    import psutil

    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name() == "java":
                return p.pid
    return None


def job_hvd(a) -> dict:
    """hvd_spark in this process: a default ``local_session``, one fit (no transform)."""
    t_enter = time.time()
    import hvd_spark

    lines = _Lines()
    log = logging.getLogger("hvd_spark")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    t_imported = time.time()
    spark = hvd_spark.local_session("local[2]", app_name="hvd_spark-bench-vs-keras")
    spark.sparkContext.setLogLevel("ERROR")
    t_session = time.time()
    store = tempfile.mkdtemp(prefix="vs_keras-store-")
    kw = {} if a.num_proc is None else {"num_proc": a.num_proc}
    est = hvd_spark.HorovodEstimator(
        **kw,
        store=store,
        model=_model(),
        optimizer="adam",
        loss="binary_crossentropy",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=a.batch,
        epochs=a.epochs,
        materialize=a.materialize,
        random_seed=0,
        callbacks=[_marks_callback(a.marks)],
        verbose=0,
    )
    out: dict = {"global_batch_asked": a.global_batch, "batch_per_rank": a.batch, "materialize": a.materialize}
    jvm = _jvm_pid()
    t0 = time.time()
    try:
        model = est.fit(spark.read.parquet(a.table))
    except Exception as exc:  # noqa: BLE001 - a failed fit is a result (the memory run's copy may run out of heap)
        out.update(outcome="failed", error=f"{type(exc).__name__}: {str(exc)[:2000]}", fit_s=time.time() - t0)
        out["peak_rss"] = {"driver_python": vm_hwm(), "driver_jvm": vm_hwm(jvm) if jvm else None}
        with contextlib.suppress(Exception):
            spark.stop()
        shutil.rmtree(store, ignore_errors=True)
        return out
    t_returned = time.time()
    s = model.getFitSummary()
    ranks = len(s.ranks)
    rank_marks = {r.rank: _read(a.marks, f"rank-{r.rank}") for r in s.ranks}
    m0 = rank_marks[0]
    last_epoch_end = m0["epoch_end"][-1]
    finished = [t for t, msg in lines.records if "ranks finished in" in msg]
    rows = s.steps_per_epoch * ranks * a.batch  # whole batches (the last one of an epoch may be short)
    hist = model.getHistory()
    out.update(
        outcome="ok",
        ranks=ranks,
        global_batch=a.batch * ranks,
        steps_per_epoch=s.steps_per_epoch,
        import_s=t_imported - t_enter,
        session_s=t_session - t_imported,
        fit_s=t_returned - t0,
        materialize_s=s.materialize_seconds,
        train_job_s=s.train_job_seconds,
        train_s=m0["train_end"] - m0["train_begin"],
        train_rows_per_s=min(rows, a.rows) * a.epochs / (m0["train_end"] - m0["train_begin"]),
        step_ms=_step_ms(m0, s.steps_per_epoch),
        final_loss=float(hist["loss"][-1]) if hist.get("loss") else None,
        tail_s=t_returned - last_epoch_end,
        tail_ranks_finished_s=(finished[-1] - last_epoch_end) if finished else None,
        ranks_left_training_after_s={
            str(r.rank): rank_marks[r.rank]["train_begin"] + (r.train_seconds or 0.0) - last_epoch_end for r in s.ranks
        },
        startup={str(r.rank): r.startup for r in s.ranks},
        peak_rss={
            "driver_python": vm_hwm(),
            "driver_jvm": vm_hwm(jvm) if jvm else None,
            "ranks": {str(r): rank_marks[r].get("vm_hwm") for r in sorted(rank_marks)},
        },
    )
    spark.stop()
    shutil.rmtree(store, ignore_errors=True)
    return out


# --- the parent: runs every job in its own process ------------------------------------------------


def run_job(kind: str, table: str, rows: int, batch: int, *, epochs: int = EPOCHS, **extra) -> dict:
    """Runs one job in a fresh process (its own session and process group); its result, with the
    whole job's wall time seen from here."""
    marks = tempfile.mkdtemp(prefix="vs_keras-marks-")
    cmd = [sys.executable, "-m", "benchmarks.bench_vs_keras", "--job", kind, "--table", table]
    cmd += ["--rows", str(rows), "--batch", str(batch), "--epochs", str(epochs), "--marks", marks]
    for k, v in extra.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):  # TF's defaults
        env.pop(k, None)
    out, err, returncode, whole = run_in_group(cmd, env, JOB_TIMEOUT_S)
    shutil.rmtree(marks, ignore_errors=True)
    found = [line for line in out.splitlines() if line.startswith("{")]
    if not found:
        tail = "\n".join((err or "").strip().splitlines()[-8:])
        return {
            "outcome": "failed",
            "error": f"no result (exit {returncode}); stderr tail:\n{tail}",
            "whole_s": whole,
        }
    result = json.loads(found[-1])
    result.setdefault("outcome", "ok")
    result["whole_s"] = whole
    return result


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get("outcome") == "ok" and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("outcome") == "ok"]
    out: dict = {"runs_ok": len(ok), "runs": len(runs)}
    for key in ("whole_s", "fit_s", "train_s", "train_rows_per_s", "step_ms", "final_loss", "tail_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            out[key] = stats(vals)
    tails = [r["tail_ranks_finished_s"] for r in ok if r.get("tail_ranks_finished_s") is not None]
    if tails:
        out["tail_ranks_finished_s"] = stats(tails)
    return out


def _peaks(runs: list[dict]) -> dict:
    """The largest peak RSS per process over the runs, MiB."""
    out: dict = {}
    for r in runs:
        for name, v in (r.get("peak_rss") or {}).items():
            if isinstance(v, dict):
                for rank, b in v.items():
                    if b:
                        key = f"rank_{rank}"
                        out[key] = max(out.get(key, 0.0), b / MIB)
            elif v:
                out[name] = max(out.get(name, 0.0), v / MIB)
    return out


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def grid(table: str, rows: int, b: int, repeats: int, default_ranks: list[int], systems=SYSTEMS) -> dict:
    """Plain Keras and the hvd_spark layouts of ``systems`` at B per rank (2B global), alternated,
    ``repeats`` times."""
    systems = ("plain", *[s for s in systems if s != "plain"])
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(repeats):
        for system in systems:
            if system == "plain":
                r = run_job("plain", table, rows, 2 * b)
            elif system == "hvd_2ranks":
                r = run_job("hvd", table, rows, b, num_proc=2, global_batch=2 * b)
            else:
                guess = default_ranks[0]
                r = run_job("hvd", table, rows, max(1, 2 * b // guess), global_batch=2 * b)
                if r.get("outcome") == "ok" and r.get("ranks") != guess:
                    default_ranks[0] = r["ranks"]  # the layout's count: run again at 2B / ranks
                    print(f"   default layout: {r['ranks']} rank(s), not {guess}: again at the right batch", flush=True)
                    r = run_job("hvd", table, rows, max(1, 2 * b // r["ranks"]), global_batch=2 * b)
            runs[system].append(r)
            brief = {k: r.get(k) for k in ("outcome", "whole_s", "fit_s", "train_rows_per_s", "tail_s", "ranks")}
            print(f"   N={rows:,} B={b} repeat {rep + 1} {system}: {json.dumps(brief)}", flush=True)
            if r.get("outcome") != "ok":
                print(f"     error: {r.get('error')}", flush=True)
    entry: dict = {"rows": rows, "batch_per_rank": b, "global_batch": 2 * b, "runs": runs}
    entry["medians"] = {s: _summary(runs[s]) for s in systems}
    entry["peak_rss_mib"] = {s: _peaks(runs[s]) for s in systems}
    entry["ratios"] = {}
    for s in systems[1:]:
        entry["ratios"][s] = {
            "whole_over_plain": _ratio(_median(runs[s], "whole_s"), _median(runs["plain"], "whole_s")),
            "fit_over_plain": _ratio(_median(runs[s], "fit_s"), _median(runs["plain"], "fit_s")),
            "train_rows_per_s_over_plain": _ratio(
                _median(runs[s], "train_rows_per_s"), _median(runs["plain"], "train_rows_per_s")
            ),
            "step_ms_over_plain": _ratio(_median(runs[s], "step_ms"), _median(runs["plain"], "step_ms")),
        }
    return entry


def memory_run(tmp: str, sizes: list[int], tables: dict[int, str], budget_s: float | None) -> dict:
    """Copied and in place, 1 epoch at MEM_BATCH per rank, 2 ranks: peak RSS per process per N; a
    size past the second is run only when the previous size's jobs took under ``budget_s``."""
    out: dict = {"batch_per_rank": MEM_BATCH, "epochs": 1, "num_proc": 2, "sizes": {}}
    took = 0.0
    for i, n in enumerate(sizes):
        if i >= 2 and budget_s is not None and took > budget_s:
            out["sizes"][str(n)] = {"skipped": f"the {sizes[i - 1]:,}-row jobs took {took:.0f} s (> {budget_s:.0f} s)"}
            print(f"   memory: {n:,} rows skipped ({took:.0f} s for the previous size)", flush=True)
            continue
        table = tables.get(n) or _table(tmp, n, tables)
        t0 = time.time()
        entry: dict = {}
        for mode, name in (("always", "copy"), ("never", "in_place")):
            r = run_job("hvd", table, n, MEM_BATCH, epochs=1, num_proc=2, materialize=mode, global_batch=2 * MEM_BATCH)
            entry[name] = {
                k: r.get(k) for k in ("outcome", "error", "whole_s", "fit_s", "materialize_s", "peak_rss", "tail_s")
            }
            brief = {k: r.get(k) for k in ("outcome", "whole_s", "fit_s")}
            print(f"   memory N={n:,} {name}: {json.dumps(brief)} peak RSS {json.dumps(_peaks([r]))}", flush=True)
            if r.get("outcome") != "ok":
                print(f"     error: {str(r.get('error'))[:600]}", flush=True)
        took = time.time() - t0
        out["sizes"][str(n)] = entry
    return out


def _table(tmp: str, n: int, tables: dict[int, str]) -> str:
    path = os.path.join(tmp, f"table-{n}")
    t0 = time.time()
    size = make_table(path, n)
    print(f"   table of {n:,} rows: {size / MIB:.0f} MiB in {time.time() - t0:.0f} s", flush=True)
    tables[n] = path
    return path


def _target(name: str, value, limit: float, at_most: bool, note: str = "") -> dict:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"target": name, "value": value, "limit": limit, "at_most": at_most, "met": met, "note": note}


def targets(out: dict) -> list[dict]:
    res = []
    big = max((e["rows"] for e in out.get("grid") or []), default=0)
    for e in out["grid"]:
        for s, r in e["ratios"].items():
            where = f"{s}, N={e['rows']:,}, B={e['batch_per_rank']}"
            if e["rows"] == big:
                limit = 1.3 if e["batch_per_rank"] >= 512 else 1.6
                res.append(_target(f"whole job / plain Keras, {where}", r["whole_over_plain"], limit, True))
            res.append(_target(f"training rows/s / plain Keras, {where}", r["train_rows_per_s_over_plain"], 0.8, False))
    tails = [
        r["tail_s"]
        for e in out["grid"]
        for s in e["ratios"]
        for r in e["runs"][s]
        if r.get("outcome") == "ok" and r.get("tail_s") is not None
    ]
    res.append(
        _target(
            "tail (rank 0's last epoch end to fit returning), the largest over every hvd_spark run",
            max(tails) if tails else None,
            TAIL_LIMIT_S,
            True,
            f"{sum(t > TAIL_LIMIT_S for t in tails)} of {len(tails)} runs over the limit",
        )
    )
    mem = out.get("memory", {}).get("sizes", {})
    sizes = sorted(int(n) for n, v in mem.items() if "skipped" not in v)
    if len(sizes) >= 2:
        lo = sizes[0]
        for n in sizes[1:]:
            for mode in ("copy", "in_place"):
                a, b = _peaks([mem[str(n)][mode]]), _peaks([mem[str(lo)][mode]])
                failed = mem[str(n)][mode].get("outcome") != "ok"
                for proc in ("driver_jvm", "ranks"):
                    if proc == "ranks":
                        va = max((v for k, v in a.items() if k.startswith("rank_")), default=None)
                        vb = max((v for k, v in b.items() if k.startswith("rank_")), default=None)
                    else:
                        va, vb = a.get(proc), b.get(proc)
                    note = "the fit failed: " + str(mem[str(n)][mode].get("error"))[:200] if failed else ""
                    value = None if failed else _ratio(va, vb)
                    res.append(
                        _target(f"peak RSS {proc}, {mode}, {n:,} / {lo:,} rows", value, 1.2, True, note)
                        | {"mib": [vb, va]}
                    )
    return res


def main(
    quick: bool, part: str = "all", only_sizes: list[int] | None = None, systems=SYSTEMS, repeats: int | None = None
) -> dict:
    """``part``: ``all``; ``grid`` (the protocol) or ``memory`` (the memory run) alone, the other part
    kept from the results file of an earlier run (both are then said in ``parts``). ``systems``: the
    hvd_spark layouts run beside plain Keras (said in the results)."""
    sizes = only_sizes or ([200_000] if quick else [1_000_000, 5_000_000])
    batches = [512, 64]
    repeats = repeats or (1 if quick else 2)
    mem_sizes = [200_000, 1_000_000] if quick else [1_000_000, 20_000_000, 40_000_000]
    t_all = time.time()
    out: dict = {
        "what": (
            f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1 ({PARAMS:,} params), Adam, {EPOCHS} epochs, a Parquet table of N rows "
            f"({FEATURES}-float array, binary label; files of {ROWS_PER_FILE:,} rows, row groups of {ROW_GROUP:,}); "
            "plain Keras in a fresh process (pyarrow read, batch 2B, TF's default threads) against hvd_spark read in "
            "place (num_proc=2 at batch B per rank; the default layout at 2B / ranks), each job a fresh process on "
            "local[2], timed from outside (whole job) and inside"
        ),
        "quick": quick,
        "sizes": sizes,  # the protocol's are 1M and 5M (--sizes runs fewer: said here)
        "repeats": repeats,
        "systems": list(systems),
        "cpus": os.cpu_count(),
        "grid": [],
    }
    default_ranks = [1]  # the default layout's rank count, corrected by the first fit that reports it
    tmp = tempfile.mkdtemp(prefix="vs_keras-")
    tables: dict[int, str] = {}
    try:
        for n in sizes if part in ("all", "grid") else []:
            table = tables.get(n) or _table(tmp, n, tables)
            for b in batches:
                print(f"== N={n:,} B={b} (global {2 * b})", flush=True)
                out["grid"].append(grid(table, n, b, repeats, default_ranks, systems))
        if part in ("all", "memory"):
            print("== memory run", flush=True)
            for n in [n for n in list(tables) if n not in mem_sizes]:
                shutil.rmtree(tables.pop(n), ignore_errors=True)  # the grid's tables: room for the big ones
            out["memory"] = memory_run(tmp, mem_sizes, tables, None if quick else 450.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["parts"] = _merge_earlier(out, part)
    out["targets"] = targets(out)
    out["wall_s"] = time.time() - t_all
    for t in out["targets"]:
        print(f"target {t['target']}: {t['value']} ({'<=' if t['at_most'] else '>='} {t['limit']}): {t['met']}")
    path = write("vs_keras", out)
    print(f"wrote {path}")
    return out


def _merge_earlier(out: dict, part: str) -> dict:
    """With ``part`` not ``all``, the other part from the results file of an earlier run (its date kept)."""
    now = time.strftime("%Y-%m-%d %H:%M")
    if part == "all":
        return {"grid": now, "memory": now}
    path = os.path.join(RESULTS, "vs_keras.json")
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        earlier = {}
    other = "memory" if part == "grid" else "grid"
    if other in earlier and not earlier.get("quick"):
        out[other] = earlier[other]
        when = (earlier.get("parts") or {}).get(other) or earlier.get("environment", {}).get("date")
        return {part: now, other: when}
    return {part: now}


def _job_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=("plain", "hvd"), required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--marks", required=True)
    p.add_argument("--num-proc", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--materialize", default="never")
    a = p.parse_args(argv)
    result = job_plain(a) if a.job == "plain" else job_hvd(a)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if "--job" in sys.argv:
        _job_main(sys.argv[1:])
    else:
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true", help="200k rows, 1 repeat, a small memory run")
        p.add_argument("--part", choices=("all", "grid", "memory"), default="all", help="run one part alone")
        p.add_argument("--sizes", type=int, nargs="+", default=None, help="the grid's row counts (default 1M 5M)")
        p.add_argument("--systems", nargs="+", choices=SYSTEMS[1:], default=list(SYSTEMS[1:]), help="hvd_spark layouts")
        p.add_argument("--repeats", type=int, default=None, help="runs of each job (default 2; 1 with --quick)")
        args = p.parse_args()
        main(args.quick, args.part, args.sizes, tuple(args.systems), args.repeats)
