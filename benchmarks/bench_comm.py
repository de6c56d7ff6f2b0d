"""Communication microbenchmark: Horovod allreduce bus bandwidth over Gloo (2 ranks), against the
machine's bidirectional loopback TCP bandwidth and memcpy bandwidth measured in the same run;
and tensor fusion on / off on a model with many small tensors.

Ranks sharing a host (issue 38): the same allreduce sweep, 4 KiB - 64 MiB, and the step time of the
protocol MLP (32-256-256-1, 74,497 params, 298 KB of gradients, Adam, ``hvd_spark.keras.make_distributed``)
for each of :data:`VARIANTS` (Gloo over loopback TCP; MPI, whose ranks on one host talk through Open MPI's
shared-memory BTL; Horovod's cycle time and hierarchical allreduce), 2 ranks x 1 TF thread at batch
64 and 512 per rank, side by side in one run; and the same MLP on ONE rank with 2 TF threads at batch
128 and 1024 (one rank per host on all its cores: no allreduce).

    python -m benchmarks.bench_comm [--quick]
"""

import socket
import sys
import threading
import time

import cloudpickle
import numpy as np

from benchmarks.common import cli, session, stats, write

# The ranks run in fresh processes that cannot import this folder: ship this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# Rank layouts and Horovod / Open MPI settings compared for 2 ranks on one host: (label, backend, env).
VARIANTS = [
    ("gloo", "gloo", {}),
    ("gloo, cycle 0.1 ms", "gloo", {"HOROVOD_CYCLE_TIME": "0.1"}),
    ("mpi", "mpi", {}),
    ("mpi, cycle 0.1 ms", "mpi", {"HOROVOD_CYCLE_TIME": "0.1"}),
    ("mpi, hierarchical", "mpi", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}),
    ("mpi, yield when idle", "mpi", {"OMPI_MCA_mpi_yield_when_idle": "1"}),
    ("mpi over tcp (no shared memory)", "mpi", {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp"}),
]
MLP_IN, MLP_WIDTH = 32, 256


def allreduce_sweep(sizes, repeats):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    return _sweep(hvd, tf, sizes, repeats)


def _sweep(hvd, tf, sizes, repeats):
    tick = tf.zeros([1])
    out = {}
    for size in sizes:
        t = tf.ones([max(1, size // 4)], tf.float32)
        for _ in range(2):
            hvd.allreduce(t, op=hvd.Sum).numpy()
        times = []
        for _ in range(repeats):
            hvd.allreduce(tick, op=hvd.Sum).numpy()  # line the ranks up
            t0 = time.perf_counter()
            hvd.allreduce(t, op=hvd.Sum).numpy()
            times.append(time.perf_counter() - t0)
        out[size] = times
    return out


def _open_mpi_components() -> list[str]:
    """The Open MPI components mapped in this process (``mca_pml_ob1``, ``mca_btl_vader``, ...): the
    candidates Open MPI opened, a superset of those it selected (``OMPI_MCA_btl_base_verbose=30`` logs
    the choice: ``bml: Using vader btl for send to ...``)."""
    import re

    try:
        with open("/proc/self/maps") as f:
            names = set(re.findall(r"mca_(?:pml|btl|coll)_\w+", f.read()))
    except OSError:
        return []
    return sorted(names)


def step_times(batches, steps, warmup):
    """Per-step seconds of the protocol MLP on this rank, for each batch size in ``batches`` (one fit of
    ``warmup + steps`` steps on random in-memory rows; the time between consecutive batch ends, the
    first ``warmup`` dropped). TF's threads: ``HVD_SPARK_NUM_THREADS`` (the launcher's ``num_threads``)."""
    import os

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvd_spark.keras import make_distributed

    threads = int(os.environ.get("HVD_SPARK_NUM_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    hvd.init()

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    out = {}
    rng = np.random.default_rng(hvd.rank())
    for batch in batches:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((MLP_IN,)),
                keras.layers.Dense(MLP_WIDTH, activation="relu"),
                keras.layers.Dense(MLP_WIDTH, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(optimizer=make_distributed(keras.optimizers.Adam(1e-3)), loss="binary_crossentropy")
        x = rng.standard_normal((batch * 16, MLP_IN)).astype(np.float32)
        y = (x[:, :1] > 0).astype(np.float32)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
        clock = Clock()
        model.fit(ds, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[clock])
        out[batch] = [float(d) for d in np.diff(clock.ends[warmup:])]
    out["gradient_bytes"] = 4 * model.count_params()
    return out


def variant_job(sizes, repeats, batches, steps, warmup):
    """One launch per variant: the allreduce sweep, then the MLP's steps, then the loaded transport."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    steps_out = step_times(batches, steps, warmup)  # sets TF's threads before any op runs
    sweep = _sweep(hvd, tf, sizes, repeats) if hvd.size() > 1 else {}
    return {"sweep": sweep, "steps": steps_out, "components": _open_mpi_components()}


def fusion_job(n_tensors, elems, steps):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    tensors = [tf.ones([elems]) * i for i in range(n_tensors)]

    @tf.function
    def step():
        return [hvd.allreduce(t, op=hvd.Average, name=f"t{i}") for i, t in enumerate(tensors)]

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        _ = out[-1].numpy()
        times.append(time.perf_counter() - t0)
    return times


def loopback_bandwidth(n_bytes=256 << 20, chunk=1 << 20, repeats=3):
    """Per-direction bytes/s over TCP on 127.0.0.1 with both directions busy at once (what a ring uses)."""
    results = []
    for _ in range(repeats):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
        srv.close()
        payload = b"\0" * chunk

        def send(s, payload=payload):
            left = n_bytes
            while left > 0:
                s.sendall(payload[: min(chunk, left)])
                left -= chunk

        def recv(s):
            left, buf = n_bytes, bytearray(chunk)
            while left > 0:
                got = s.recv_into(buf, min(chunk, left))
                if not got:
                    break
                left -= got

        threads = [threading.Thread(target=f, args=(s,)) for f, s in ((send, a), (recv, b), (send, b), (recv, a))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(n_bytes / (time.perf_counter() - t0))
        a.close()
        b.close()
    return results


def memcpy_bandwidth(n_bytes=256 << 20, repeats=5):
    src = np.ones(n_bytes // 8)
    dst = np.empty_like(src)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(n_bytes / (time.perf_counter() - t0))
    return out


def memcpy_at(n_bytes: int, min_seconds: float = 0.02) -> float:
    """memcpy bytes/s at one size, looped for ``min_seconds`` (small sizes stay in cache, as an
    allreduce's buffers of that size would)."""
    src = np.ones(max(1, n_bytes // 8))
    dst = np.empty_like(src)
    np.copyto(dst, src)
    loops, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds:
        np.copyto(dst, src)
        loops += 1
    return loops * src.nbytes / elapsed


def _rows(per_rank: list[dict], sizes, mem: float, tcp: float, n: int) -> list[dict]:
    rows = []
    for size in sizes:
        # The slower rank's time of each call: the collective ends when both ranks have it.
        s = stats([max(ts) for ts in zip(*(r[size] for r in per_rank))])
        busbw = size / s["median"] * 2 * (n - 1) / n
        rows.append(
            {
                "bytes": size,
                "time_s": s,
                "busbw_Bps": busbw,
                "busbw_over_tcp": busbw / tcp,
                "busbw_over_memcpy": busbw / mem,
            }
        )
    return rows


def shared_host_section(spark, quick: bool) -> dict:
    """Every variant of :data:`VARIANTS` (2 ranks x 1 thread), then 1 rank x 2 threads, one launch each;
    in full mode two rounds, the second in reverse order, so that a slow period weighs on all of them."""
    import hvd_spark

    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    repeats, steps, warmup, rounds = (5, 100, 20, 1) if quick else (8, 150, 30, 2)
    per_rank_batches = [64, 512]
    layouts = [(label, backend, env, 2, 1, per_rank_batches) for label, backend, env in VARIANTS]
    layouts.append(("one rank, 2 threads", "gloo", {}, 1, 2, [2 * b for b in per_rank_batches]))
    runs: dict[str, list] = {label: [] for label, *_ in layouts}
    out = {"sizes": sizes, "batches_per_rank": per_rank_batches, "runs": runs}
    for i in range(rounds):
        for label, backend, env, num_proc, threads, batches in layouts if i % 2 == 0 else layouts[::-1]:
            r = hvd_spark.run(
                variant_job,
                args=(sizes, repeats, batches, steps, warmup),
                num_proc=num_proc,
                num_threads=threads,
                backend=backend,
                env=env,
                verbose=0,
            )
            runs[label].append(r)
            print(label, {b: round(float(np.median(r[0]["steps"][b])) * 1e3, 2) for b in batches}, flush=True)
    return out


def _merged(runs: list[list[dict]], key: str) -> list[dict]:
    """Per rank, the samples of every run of a layout pooled (``key``: "sweep" or "steps")."""
    merged: list[dict] = [{} for _ in runs[0]]
    for run in runs:
        for rank, result in zip(merged, run):
            for k, v in result[key].items():
                if isinstance(v, list):
                    rank.setdefault(k, []).extend(v)
    return merged


def _shared_host_summary(raw: dict, mem: float, tcp: float) -> dict:
    sizes, batches = raw["sizes"], raw["batches_per_rank"]
    memcpy_by_size = {size: memcpy_at(size) for size in sizes}
    variants = {}
    for label, backend, env in VARIANTS:
        runs = raw["runs"][label]
        rows = _rows(_merged(runs, "sweep"), sizes, mem, tcp, len(runs[0]))
        for row in rows:
            row["memcpy_same_size_Bps"] = memcpy_by_size[row["bytes"]]
            row["busbw_over_memcpy_same_size"] = row["busbw_Bps"] / memcpy_by_size[row["bytes"]]
        steps = _merged(runs, "steps")
        variants[label] = {
            "backend": backend,
            "env": env,
            "open_mpi_components_mapped": runs[0][0]["components"],
            "allreduce": rows,
            # per step: the slower rank's interval (the ranks step in lockstep through the allreduce)
            "step_s": {str(b): stats([max(ts) for ts in zip(*(r[b] for r in steps))]) for b in batches},
        }
    one_runs = raw["runs"]["one rank, 2 threads"]
    one = _merged(one_runs, "steps")[0]
    one_rank = {str(2 * b): stats(one[2 * b]) for b in batches}
    base = variants["gloo"]
    for v in variants.values():
        v["step_over_gloo"] = {b: v["step_s"][b]["median"] / base["step_s"][b]["median"] for b in v["step_s"]}
        v["step_over_one_rank_2_threads"] = {
            str(b): v["step_s"][str(b)]["median"] / one_rank[str(2 * b)]["median"] for b in batches
        }
        v["allreduce_time_over_gloo"] = {
            str(r["bytes"]): r["time_s"]["median"] / g["time_s"]["median"]
            for r, g in zip(v["allreduce"], base["allreduce"])
        }
    return {
        "ranks": 2,
        "threads_per_rank": 1,
        "rounds": len(one_runs),
        "model": f"MLP {MLP_IN}-{MLP_WIDTH}-{MLP_WIDTH}-1, Adam",
        "gradient_bytes": one_runs[0][0]["steps"]["gradient_bytes"],
        "variants": variants,
        "one_rank_2_threads": {"threads": 2, "step_s": one_rank},
    }


def main(quick: bool):
    import hvd_spark

    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20] + ([] if quick else [256 << 20])
    repeats = 5 if quick else 10
    spark = session("local[2]")
    try:
        sweep = hvd_spark.run(allreduce_sweep, args=(sizes, repeats), num_proc=2, verbose=0)
        fusion = {}
        for label, threshold in (("on", str(64 << 20)), ("off", "0")):
            r = hvd_spark.run(
                fusion_job,
                args=(256, 1024, 10 if quick else 30),
                num_proc=2,
                verbose=0,
                env={"HOROVOD_FUSION_THRESHOLD": threshold, "HOROVOD_CYCLE_TIME": "1"},
            )
            fusion[label] = stats(r[0])
        shared = shared_host_section(spark, quick)
    finally:
        spark.stop()
    tcp = stats(loopback_bandwidth(repeats=2 if quick else 3))
    mem = stats(memcpy_bandwidth())
    n = 2
    data = {
        "ranks": n,
        "allreduce": _rows(sweep, sizes, mem["median"], tcp["median"], n),
        "loopback_tcp_Bps": tcp,
        "memcpy_Bps": mem,
        "fusion": {
            "tensors": 256,
            "bytes_each": 4096,
            "step_s": fusion,
            "speedup_on_vs_off": fusion["off"]["median"] / fusion["on"]["median"],
        },
        "shared_host": _shared_host_summary(shared, mem["median"], tcp["median"]),
    }
    print(write("comm", data))
    return data


if __name__ == "__main__":
    cli(main)
