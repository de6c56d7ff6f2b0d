"""Across real network stacks: Spark Workers on network-namespace hosts (tests/netns_cluster.py)
whose links are shaped to 1 Gbit/s, each host pinned to its own CPU.

1. Allreduce bus bandwidth over 2 and 3 hosts against the alpha-beta ring prediction for the
   measured link (beta from a raw TCP stream between two hosts, alpha from the 4 KiB allreduce).
2. Scaling efficiency E(2) of bench_scaling's CNN with one rank per host, against one rank alone.
3. Synchronous ring-allreduce against parameter servers on the same linear model as bench_ps:
   - TF's ParameterServerStrategy (chief and ps on one host, the workers on the other);
   - the SparkFlow design: a PS served by the Spark driver, that plain Spark tasks (one per host)
     pull weights from and push gradients to, asynchronously, in its two modes: ``hogwild`` (updates
     applied with no lock) and ``locked`` (pulls and updates serialized by one lock).
   Each row has the alpha-beta prediction beside it.

    sudo python -m benchmarks.bench_multihost [--quick]

Needs root (network namespaces and ``tc``). The kernel here has no ``sch_netem`` (modules are off),
so there is no added delay: links are shaped with ``tbf`` (a rate and a burst) and the latency is
what the veth, the bridge and the stacks give. What the hosts still share is said in the results.
"""

import os
import socket
import socketserver
import subprocess
import sys
import threading
import time

import cloudpickle

from benchmarks import bench_ps
from benchmarks.bench_comm import allreduce_sweep
from benchmarks.bench_scaling import throughput_job
from benchmarks.common import cli, stats, write

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(bench_ps)

RATE_MBIT = 1000  # every host's link (and the driver's), each direction
BURST = "256kb"  # tbf burst: above rate / HZ, so that the rate holds at 1 Gbit/s
PS_BATCH = bench_ps.BATCH
PS_LR = 0.01


def _netns_cluster():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import netns_cluster

    return netns_cluster


def _tbf(prefix: list[str], dev: str) -> None:
    cmd = [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{RATE_MBIT}mbit"]
    subprocess.run([*cmd, "burst", BURST, "latency", "50ms"], check=True)


def shape(nc, cluster) -> None:
    """Each host's egress (its eth0) and the driver's egress (the bridge device, which carries what
    the root namespace sends) at RATE_MBIT: a host-to-host transfer crosses one shaped sender link."""
    for i in cluster.host_indices():
        _tbf(["ip", "netns", "exec", nc.netns_name(i)], "eth0")
    _tbf([], nc.BRIDGE)


RECEIVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n / (time.perf_counter() - t0), flush=True)
"""

SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
"""


def link_bandwidth(nc, a: int, b: int, mib: int = 128) -> float:
    """Bytes/s of one TCP stream from host ``a`` to host ``b`` (through the shaped links)."""
    rx = subprocess.Popen(
        ["ip", "netns", "exec", nc.netns_name(b), sys.executable, "-c", RECEIVER, nc.host_ip(b)],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = rx.stdout.readline().strip()
    tx = [sys.executable, "-c", SENDER, nc.host_ip(b), port, str(mib)]
    subprocess.run(["ip", "netns", "exec", nc.netns_name(a), *tx], check=True, timeout=300)
    out, _ = rx.communicate(timeout=60)
    return float(out.strip())


def ring_time(n: int, size: int, alpha: float, bandwidth: float) -> float:
    """Ring allreduce: 2(n-1) steps of latency alpha, each rank sending 2(n-1)/n of the data."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bandwidth


# --- the SparkFlow design: a PS in the driver, plain Spark tasks as workers ---


class DriverPS:
    """Weights of a ``d x k`` linear model, served over TCP by the driver. ``P`` sends the weights;
    ``G`` + a gradient applies ``w -= lr * g``. ``locked``: one lock around pulls and updates
    (SparkFlow's locked mode); otherwise updates race with each other and with pulls (hogwild)."""

    def __init__(self, d: int, k: int, host: str, locked: bool):
        import numpy as np

        self.w = np.zeros((d, k), np.float32)
        self.nbytes = self.w.nbytes
        self.lock = threading.Lock() if locked else None
        ps = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                grad = np.empty_like(ps.w)
                view = memoryview(grad).cast("B")
                sock = self.request
                while True:
                    op = sock.recv(1)
                    if not op:
                        return
                    if op == b"P":
                        if ps.lock is None:
                            sock.sendall(memoryview(ps.w).cast("B"))
                        else:
                            with ps.lock:
                                snapshot = ps.w.copy()
                            sock.sendall(memoryview(snapshot).cast("B"))
                    else:
                        got = 0
                        while got < ps.nbytes:
                            got += sock.recv_into(view[got:], ps.nbytes - got)
                        if ps.lock is None:
                            np.subtract(ps.w, PS_LR * grad, out=ps.w)
                        else:
                            with ps.lock:
                                np.subtract(ps.w, PS_LR * grad, out=ps.w)

        self.server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.addr = (host, self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def sparkflow_worker(index, addr, d, k, steps):
    """One Spark task: pull, gradient of one batch (numpy), push; ``steps`` times after one warm-up."""
    import numpy as np

    rng = np.random.default_rng(index)
    x = rng.standard_normal((PS_BATCH, d), dtype=np.float32)
    y = np.zeros((PS_BATCH, k), np.float32)
    w = np.empty((d, k), np.float32)
    view = memoryview(w).cast("B")
    sock = socket.create_connection(addr)
    marks = []
    for _ in range(steps + 1):
        sock.sendall(b"P")
        got = 0
        while got < w.nbytes:
            got += sock.recv_into(view[got:], w.nbytes - got)
        g = x.T @ (x @ w - y) * (2.0 / (PS_BATCH * k))
        sock.sendall(b"G")
        sock.sendall(memoryview(np.ascontiguousarray(g, np.float32)).cast("B"))
        marks.append(time.time())
    sock.close()
    return [(index, socket.gethostname(), marks)]


def sparkflow_step(spark, host: str, n: int, size: int, steps: int, locked: bool) -> dict:
    """Global-step time (n batches, one per worker) of the driver-hosted PS, and the final weight norm."""
    d, k = bench_ps._model_dims(size)
    ps = DriverPS(d, k, host, locked)
    addr = ps.addr
    try:
        rdd = spark.sparkContext.parallelize(range(n), n)
        out = rdd.mapPartitionsWithIndex(lambda i, _: sparkflow_worker(i, addr, d, k, steps)).collect()
    finally:
        ps.close()
    start = max(marks[0] for _, _, marks in out)  # every worker past its warm-up step
    end = max(marks[-1] for _, _, marks in out)
    done = sum(sum(1 for m in marks[1:] if m > start) for _, _, marks in out)  # batches after `start`
    return {"global_step_s": (end - start) / (done / n), "batches": done}


# --- the runs ---


def _session(nc, cluster, cores_max: int):
    import hvd_spark

    os.environ["SPARK_LOCAL_IP"] = cluster.driver_ip
    conf = dict(cluster.spark_conf(), **{"spark.cores.max": str(cores_max), "spark.executor.cores": "1"})
    spark = hvd_spark.local_session(cluster.master_url, app_name="hvd_spark-bench-multihost", conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.monotonic() + 120
    while spark.sparkContext.defaultParallelism < cores_max:  # executors register after the session starts
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {spark.sparkContext.defaultParallelism} of {cores_max} cores registered")
        time.sleep(0.5)
    return spark


def allreduce_rows(sweep, n, sizes, repeats, bandwidth):
    times = {size: stats([max(r[size][k] for r in sweep) for k in range(repeats)]) for size in sizes}
    alpha = times[sizes[0]]["median"] / (2 * (n - 1))  # the smallest message is (almost) all latency
    rows = []
    for size in sizes:
        t = times[size]["median"]
        pred = ring_time(n, size, alpha, bandwidth)
        rows.append(
            {
                "bytes": size,
                "time_s": times[size],
                "busbw_Bps": size / t * 2 * (n - 1) / n,
                "predicted_time_s": pred,
                "predicted_busbw_Bps": size / pred * 2 * (n - 1) / n,
                "measured_over_predicted_busbw": pred / t,
            }
        )
    return alpha, rows


def run_hosts(nc, n, sizes, repeats, scaling, ps_sizes, ps_steps, workdir):
    import hvd_spark

    cpus = list(range(os.cpu_count() or 1))
    cluster = nc.NetnsCluster(hosts=n, hostnames="own", cores=2, workdir=workdir, cpus=cpus)
    cluster.start()
    pins = {nc.host_ip(i): cpus[(i - 2) % len(cpus)] for i in cluster.host_indices()}
    out: dict = {"hosts": n, "cpu_of_host": pins}
    try:
        shape(nc, cluster)
        bandwidth = link_bandwidth(nc, 2, 3)
        out["link_Bps"] = bandwidth
        spark = _session(nc, cluster, n)  # one 1-core executor per host: one rank per host
        try:
            sweep = hvd_spark.run(allreduce_sweep, args=(sizes, repeats), num_proc=n, verbose=0, start_timeout=180)
            alpha, rows = allreduce_rows(sweep, n, sizes, repeats, bandwidth)
            out.update(alpha_s=alpha, allreduce=rows)
            if scaling:
                steps, epochs = scaling
                one = hvd_spark.run(throughput_job, args=(steps, epochs), num_proc=1, verbose=0, start_timeout=180)
                alln = hvd_spark.run(throughput_job, args=(steps, epochs), num_proc=n, verbose=0, start_timeout=180)
                x1, xn = stats(one[0])["median"], stats(alln[0])["median"]
                out["scaling"] = {"samples_per_s_1_rank": x1, f"samples_per_s_{n}_ranks": xn, f"E{n}": xn / (n * x1)}
            if ps_sizes:
                out["ps"] = ps_rows(spark, cluster, n, ps_sizes, ps_steps, alpha, bandwidth)
        finally:
            spark.stop()
        if ps_sizes:
            spark = _session(nc, cluster, 2 * n)  # chief + ps + 2 workers need 4 slots
            try:
                for row in out["ps"]:
                    tf_ps = hvd_spark.run(
                        bench_ps.ps_job,
                        args=(row["bytes"], ps_steps, n),
                        num_proc=n + 2,
                        verbose=0,
                        timeout=900,
                        start_timeout=180,
                        env={"TF_NUM_INTEROP_THREADS": "4"},
                    )
                    row["tf_ps_step_s"] = stats(tf_ps[0])
                    row["tf_ps_over_allreduce"] = row["tf_ps_step_s"]["median"] / row["allreduce_step_s"]["median"]
            finally:
                spark.stop()
    finally:
        cluster.stop()
    return out


def ps_rows(spark, cluster, n, sizes, steps, alpha, bandwidth):
    import hvd_spark

    rows = []
    for size in sizes:
        ar = hvd_spark.run(bench_ps.allreduce_job, args=(size, steps), num_proc=n, verbose=0, start_timeout=180)
        ar_s = stats([max(ts) for ts in zip(*ar)])
        row = {"workers": n, "bytes": size, "allreduce_step_s": ar_s}
        for mode in ("hogwild", "locked"):
            r = sparkflow_step(spark, cluster.driver_ip, n, size, steps, locked=mode == "locked")
            row[f"sparkflow_{mode}_step_s"] = r["global_step_s"]
            row[f"sparkflow_{mode}_over_allreduce"] = r["global_step_s"] / ar_s["median"]
        # Alpha-beta beside each: the ring moves 2(n-1)/n of the model per rank per step. A driver PS
        # sends n pulls through its one link per global step and takes n pushes, one per host link.
        row["predicted_allreduce_s"] = ring_time(n, size, alpha, bandwidth)
        row["predicted_driver_ps_s"] = 2 * alpha + n * size / bandwidth + size / bandwidth
        row["predicted_tf_ps_s"] = 2 * alpha + 2 * n * size / bandwidth / 2  # ps and workers on two hosts
        rows.append(row)
        print(
            f"{n} hosts {size >> 20} MiB: allreduce {ar_s['median']:.3f} s, driver PS hogwild "
            f"{row['sparkflow_hogwild_step_s']:.3f} s, locked {row['sparkflow_locked_step_s']:.3f} s",
            flush=True,
        )
    return rows


def main(quick: bool):
    import tempfile

    nc = _netns_cluster()
    ok, why = nc.can_create_namespaces()
    if not ok:
        raise SystemExit(f"bench_multihost needs network namespaces: {why}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sizes = [4 << 10, 256 << 10, 4 << 20, 16 << 20] + ([] if quick else [64 << 20])
    repeats = 5 if quick else 10
    scaling = (20, 2) if quick else (40, 3)
    ps_sizes = [1 << 20, 16 << 20] + ([] if quick else [64 << 20])
    ps_steps = 5 if quick else 10
    results = {}
    for n in (2, 3):
        results[str(n)] = run_hosts(
            nc,
            n,
            sizes,
            repeats,
            scaling if n == 2 else None,  # 2 cores: a third host would share a core with another
            ps_sizes if n == 2 else None,
            ps_steps,
            tempfile.mkdtemp(prefix=f"bench-mh{n}-"),
        )
        busbw = [round(r["busbw_Bps"] / 1e6, 1) for r in results[str(n)]["allreduce"]]
        print(n, "hosts: busbw", busbw, "MB/s", flush=True)
    data = {
        "network": {
            "rate_mbit_per_link": RATE_MBIT,
            "qdisc": f"tbf rate {RATE_MBIT}mbit burst {BURST} at each host's eth0 and the bridge (driver's egress)",
            "added_delay": "none: this kernel has no sch_netem (built without it, modules off)",
        },
        "what_is_shared": (
            f"{os.cpu_count()} cores for every host (each host's Worker and its children pinned to one core; with 3 "
            "hosts two share a core), one kernel, one memory bus, the Spark Master and the driver in the root "
            "namespace. The driver's incoming traffic is limited only by each sender's link."
        ),
        "results": results,
    }
    print(write("multihost", data))
    return data


if __name__ == "__main__":
    cli(main)
