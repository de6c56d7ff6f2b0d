"""The headline: synchronous ring-allreduce (Horovod in hvd_spark's barrier launcher) against a
parameter server (TensorFlow's ParameterServerStrategy with a ClusterCoordinator), on the same
model, batch size, optimizer and Spark barrier machinery.

Algorithms, exactly:
- allreduce: synchronous data parallel SGD. Every step, each of the n workers computes the
  gradient of its own batch, the gradients are averaged with Horovod's ring-allreduce over Gloo,
  and every worker applies the same update.
- ps: asynchronous parameter server. One ps task holds the variables; a chief schedules steps
  with ClusterCoordinator; each step, a worker reads the variables from the ps, computes the
  gradient of one batch and applies it on the ps, with no barrier between workers.
For a fair unit, both are timed per "global step" = n batches processed (one per worker).

    python -m benchmarks.bench_ps [--quick]
"""

import os
import socket
import sys
import time

import cloudpickle

from benchmarks.common import cli, session, stats, write

# The ranks run in fresh processes that cannot import this folder: ship this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 8
OUT_DIM = 256


def _model_dims(n_bytes):
    return max(1, n_bytes // 4 // OUT_DIM), OUT_DIM


def allreduce_job(n_bytes, steps):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    d, k = _model_dims(n_bytes)
    w = tf.Variable(tf.zeros([d, k]))
    x = tf.random.stateless_normal([BATCH, d], seed=[hvd.rank(), 1])
    y = tf.zeros([BATCH, k])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        g = tape.gradient(loss, w)
        g = hvd.allreduce(g, op=hvd.Average)
        w.assign_sub(0.01 * g)
        return loss

    for _ in range(2):
        step().numpy()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - t0)
    return times


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # the benchmark accepts the small race: TF's server binds the port itself
    return port


def ps_job(n_bytes, steps, workers):
    """Rank 0: chief (coordinator); rank 1: ps; ranks 2..: workers. Horovod only exchanges addresses
    (each task's TF server is reached at its host's address: loopback on one machine)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank = hvd.rank()
    addr = os.environ.get("HVD_SPARK_HOST", "127.0.0.1")
    addrs = hvd.allgather_object(f"{addr}:{_free_port()}")
    spec = tf.train.ClusterSpec({"chief": [addrs[0]], "ps": [addrs[1]], "worker": addrs[2 : 2 + workers]})
    times = []
    if rank == 0:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        d, k = _model_dims(n_bytes)
        with strategy.scope():
            w = tf.Variable(tf.zeros([d, k]))

        def dataset_fn():
            x = tf.random.stateless_normal([BATCH, d], seed=[3, 1])
            return tf.data.Dataset.from_tensors((x, tf.zeros([BATCH, k]))).repeat()

        it = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def step(iterator):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
                w.assign_sub(0.01 * tape.gradient(loss, w))
                return loss

            x, y = next(iterator)
            return strategy.run(replica, args=(x, y))

        for _ in range(workers):  # warm-up: one step per worker
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        for _ in range(steps):
            t0 = time.perf_counter()
            for _ in range(workers):  # one global step = one batch per worker
                coordinator.schedule(step, args=(it,))
            coordinator.join()
            times.append(time.perf_counter() - t0)
    else:
        job, index = ("ps", 0) if rank == 1 else ("worker", rank - 2)
        server = tf.distribute.Server(spec, job_name=job, task_index=index, protocol="grpc", start=True)
        del server
    hvd.allreduce(tf.zeros([1]), name="ps_done").numpy()  # servers live until the chief is done
    return times


def main(quick: bool, comm=None):
    import hvd_spark

    sizes = [1 << 20, 16 << 20, 64 << 20] + ([] if quick else [256 << 20])
    worker_counts = [2, 4] if quick else [2, 3, 4]
    steps = 5 if quick else 10
    spark = session(f"local[{max(worker_counts) + 2}]")
    rows = []
    try:
        for n in worker_counts:
            for size in sizes:
                ar = hvd_spark.run(allreduce_job, args=(size, steps), num_proc=n, verbose=0)
                ar_s = stats([max(ts) for ts in zip(*ar)])
                # A ps / worker serves remote steps while its Python thread waits in the final allreduce:
                # with one inter-op thread that wait starves the server. Intra-op (compute) stays at 1.
                ps = hvd_spark.run(
                    ps_job,
                    args=(size, steps, n),
                    num_proc=n + 2,
                    verbose=0,
                    timeout=900,
                    env={"TF_NUM_INTEROP_THREADS": "4"},
                )
                ps_s = stats(ps[0])
                rows.append(
                    {
                        "workers": n,
                        "bytes": size,
                        "allreduce_step_s": ar_s,
                        "ps_step_s": ps_s,
                        "ratio_ps_over_allreduce": ps_s["median"] / ar_s["median"],
                        "oversubscribed": n + 2 > (os.cpu_count() or 1),
                    }
                )
                print(
                    f"workers={n} size={size >> 20} MiB allreduce={ar_s['median']:.4f}s ps={ps_s['median']:.4f}s",
                    flush=True,
                )
    finally:
        spark.stop()
    model = alpha_beta(rows, comm)
    data = {
        "batch_per_worker": BATCH,
        "rows": rows,
        "alpha_beta": model,
        "algorithms": {
            "allreduce": "synchronous SGD, Horovod ring-allreduce over Gloo",
            "ps": "asynchronous PS: tf.distribute ParameterServerStrategy + ClusterCoordinator, "
            "1 ps, no barrier between workers",
        },
    }
    print(write("ps_vs_allreduce", data))
    return data


def alpha_beta(rows, comm):
    """Predicted step times from latency (alpha) and per-direction loopback bandwidth (1/beta)."""
    if not comm:
        return None
    alpha = comm["allreduce"][0]["time_s"]["median"] / 2  # a 4 KiB allreduce on 2 ranks: 2 latency hops
    bw = comm["loopback_tcp_Bps"]["median"]
    out = []
    for r in rows:
        n, size = r["workers"], r["bytes"]
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bw
        ps = 2 * alpha + 2 * n * size / bw  # the ps moves n pushes and n pulls per global step
        out.append({"workers": n, "bytes": size, "ring_s": ring, "ps_s": ps, "ratio": ps / ring})
    return {"alpha_s": alpha, "bandwidth_Bps": bw, "predictions": out}


if __name__ == "__main__":
    cli(main)
