"""hvd_spark.run demo: a ring-allreduce across 2 Horovod ranks on local Spark.

    .venv/bin/python examples/allreduce_demo.py [--num-proc 2] [--master local[2]] [--mib 16]

Each rank contributes a tensor filled with (rank + 1); the sum comes back on every rank.
It also times a float32 allreduce of --mib MiB over Gloo.
"""

import argparse
import logging


def allreduce_job(mib: int, repeats: int):
    import time

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    small = hvd.allreduce(tf.fill([4], float(hvd.rank() + 1)), op=hvd.Sum).numpy()
    big = tf.ones([mib * 1024 * 1024 // 4], tf.float32)
    hvd.allreduce(big, op=hvd.Sum)  # warm-up: sets up buffers and the fusion path
    times = []
    for _ in range(repeats):
        hvd.barrier() if hasattr(hvd, "barrier") else None
        t = time.perf_counter()
        out = hvd.allreduce(big, op=hvd.Sum)
        _ = out.numpy()[0]
        times.append(time.perf_counter() - t)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "sum": small.tolist(),
        "allreduce_ms_median": float(np.median(times) * 1e3),
    }


def main():
    import hvd_spark

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    spark = hvd_spark.local_session(a.master)
    try:
        results = hvd_spark.run(allreduce_job, args=(a.mib, a.repeats), num_proc=a.num_proc)
    finally:
        spark.stop()
    for r in results:
        print(
            f"rank {r['rank']}/{r['size']}: allreduce(sum of rank+1) = {r['sum']}; "
            f"{a.mib} MiB float32 allreduce over Gloo: {r['allreduce_ms_median']:.1f} ms (median of {a.repeats})"
        )
    expected = float(sum(range(1, a.num_proc + 1)))
    assert all(r["sum"] == [expected] * 4 for r in results), results


if __name__ == "__main__":
    main()
