"""Communication microbenchmark: Horovod allreduce bus bandwidth over Gloo (2 ranks), against the
machine's bidirectional loopback TCP bandwidth and memcpy bandwidth measured in the same run;
and tensor fusion on / off on a model with many small tensors.

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


def allreduce_sweep(sizes, repeats):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
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
    finally:
        spark.stop()
    tcp = stats(loopback_bandwidth(repeats=2 if quick else 3))
    mem = stats(memcpy_bandwidth())
    n = 2
    rows = []
    for size in sizes:
        s = stats([max(a, b) for a, b in zip(sweep[0][size], sweep[1][size])])
        busbw = size / s["median"] * 2 * (n - 1) / n
        rows.append(
            {
                "bytes": size,
                "time_s": s,
                "busbw_Bps": busbw,
                "busbw_over_tcp": busbw / tcp["median"],
                "busbw_over_memcpy": busbw / mem["median"],
            }
        )
    data = {
        "ranks": n,
        "allreduce": rows,
        "loopback_tcp_Bps": tcp,
        "memcpy_Bps": mem,
        "fusion": {
            "tensors": 256,
            "bytes_each": 4096,
            "step_s": fusion,
            "speedup_on_vs_off": fusion["off"]["median"] / fusion["on"]["median"],
        },
    }
    print(write("comm", data))
    return data


if __name__ == "__main__":
    cli(main)
