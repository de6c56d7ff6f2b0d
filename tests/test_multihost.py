"""Several hosts for real: Spark Workers in network namespaces on a bridge (tests/netns_cluster.py).

Each host has its own network stack and address (10.77.0.2, 10.77.0.3, ...); the Master and the
driver sit on the bridge (10.77.0.1). The hosts share the filesystem (as an NFS mount would), so
the store is a local folder. The driver runs in a fresh process per job (one SparkContext per
process; the suite's shared local session stays untouched). Needs root; skipped with the reason
otherwise.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import netns_cluster  # noqa: E402

pytestmark = pytest.mark.multihost

_OK, _WHY = netns_cluster.can_create_namespaces()
if not _OK:
    pytest.skip(f"multi-host tests need network namespaces: {_WHY}", allow_module_level=True)

PRELUDE = textwrap.dedent("""
    import json, os, socket, sys
    import hvd_spark
    conf = json.loads(sys.argv[1])
    spark = hvd_spark.local_session(conf.pop("master"), conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    def emit(obj):
        print("RESULT " + json.dumps(obj), flush=True)
""")

ALLREDUCE = PRELUDE + textwrap.dedent("""
    def job():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        total = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy().tolist()
        gathered = hvd.allgather(tf.constant([[hvd.rank()]])).numpy().ravel().tolist()
        return {"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
                "cross_size": hvd.cross_size(), "sum": total, "gathered": gathered,
                "host": os.environ.get("HOROVOD_HOSTNAME") or os.environ["HVD_SPARK_WORKDIR"],
                "hostname": socket.gethostname(), "mpi": hvd.mpi_enabled(), "gloo": hvd.gloo_enabled(),
                "pid": os.getpid()}
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    try:
        emit(hvd_spark.run(job, num_proc=2, verbose=0, start_timeout=120, backend=backend))
    finally:
        spark.stop()
""")

FIT = PRELUDE + textwrap.dedent("""
    import keras, numpy as np, pandas as pd
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    pdf = pd.DataFrame({"features": list((x / 16.0).astype("float32")), "label": y.astype("int64")})
    df = spark.createDataFrame(pdf).repartition(4)
    train, test = df.randomSplit([0.8, 0.2], seed=1)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=sys.argv[2], model=model, optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=6, verbose=0, start_timeout=120, backend=sys.argv[3])
    try:
        fitted = est.fit(train)
        out = fitted.transform(test).select("label", "label__output").toPandas()
        acc = float((np.stack(out["label__output"]).argmax(1) == out["label"]).mean())
        summary = fitted.getFitSummary()
        emit({"accuracy": acc, "rows": len(out), "digests": [r.weights_digest for r in summary.ranks],
              "hosts": [r.host for r in summary.ranks]})
    finally:
        spark.stop()
""")


HOSTLOSS = PRELUDE + textwrap.dedent("""
    import logging, time
    import keras, numpy as np, pandas as pd
    from sklearn.datasets import load_digits
    store, marker, start_timeout = sys.argv[2], sys.argv[3], float(sys.argv[4])
    elastic = sys.argv[5:] == ["elastic"]  # go on without the lost host and grow back when it returns

    class Slow(keras.callbacks.Callback):
        # elastic: epochs long enough (about 6 s on one rank) for the host to come back during training
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)

    class HoldOnSecondHost(keras.callbacks.Callback):
        # Mid-epoch 2 on the rank of host 10.77.0.3: leave a marker, then wait to be killed with the host.
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch == 1 and batch == 2 and os.environ.get("HOROVOD_HOSTNAME") == "10.77.0.3"
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                time.sleep(300)

    seen = {"log": []}
    class Times(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "failed" in text and "failed_at" not in seen:
                seen["failed_at"] = record.created
            if "restarting" in text:
                seen["restart_at"] = record.created
            if record.name == "hvd_spark" or record.name.startswith("hvd_spark._internal."):  # not ranks' output
                seen["log"].append([record.created, text[:200]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hvd_spark").addHandler(Times())

    x, y = load_digits(return_X_y=True)
    pdf = pd.DataFrame({"features": list((x / 16.0).astype("float32")), "label": y.astype("int64")})
    df = spark.createDataFrame(pdf).repartition(4)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    sizes = dict(num_proc=2, epochs=4)
    if elastic:
        sizes = dict(min_num_proc=1, max_num_proc=2, checkpoint_every=1, epochs=10)
    est = hvd_spark.HorovodEstimator(
        store=store, model=model, optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=32, verbose=1, start_timeout=start_timeout, max_restarts=1,
        run_id="hostloss", callbacks=[HoldOnSecondHost()] + ([Slow()] if elastic else []), **sizes)
    try:
        try:
            fitted = est.fit(df)
        except hvd_spark.HvdSparkError as e:
            emit({**seen, "error": str(e), "type": type(e).__name__, "failed_at": time.time()})
            raise SystemExit(0)
        summary = fitted.getFitSummary()
        emit({"restarts": summary.restarts, "epochs": len(fitted.getHistory()["loss"]),
              "checkpoints": [c.epoch for c in hvd_spark.Store(store).checkpoints("hostloss")],
              "accuracy": fitted.getHistory()["accuracy"][-1], "digests": [r.weights_digest for r in summary.ranks],
              "hosts": [r.host for r in summary.ranks], "finished_at": time.time(),
              "recoveries": [r.__dict__ for r in summary.recoveries], **seen})
    finally:
        spark.stop()
""")


MPI_FAILURE = PRELUDE + textwrap.dedent("""
    def job():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        if hvd.rank() == 1:
            import psutil
            here = next(a.address for a in psutil.net_if_addrs()["eth0"] if a.family == socket.AF_INET)
            raise ValueError("rank 1 gives up on " + here)
        import time
        time.sleep(600)  # rank 0 waits: mpirun must stop it

    try:
        hvd_spark.run(job, num_proc=2, verbose=0, start_timeout=120, backend="mpi")
        emit({"error": None})
    except hvd_spark.RankFailedError as e:
        emit({"error": str(e).splitlines()[0], "type": e.exc_type, "rank": e.rank, "host": e.host})
    finally:
        spark.stop()
""")


DROPPED = PRELUDE + textwrap.dedent("""
    import time
    marker = sys.argv[2]

    def job():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        for step in range(100000):
            hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
            if step == 20 and os.environ["HOROVOD_HOSTNAME"] == "10.77.0.3":
                with open(marker, "w") as f:
                    f.write(str(hvd.rank()))
            time.sleep(0.05)

    t0 = time.time()
    try:
        hvd_spark.run(job, num_proc=2, verbose=0, start_timeout=120)
        emit({"error": None})
    except hvd_spark.RankFailedError as e:
        emit({"error": str(e).splitlines()[0], "type": e.exc_type, "rank": e.rank, "host": e.host,
              "failed_at": time.time()})
    finally:
        spark.stop()
""")


def _start_driver(cluster, script, *args, workdir):
    """Starts a driver script in a fresh process on the bridge (its output in ``workdir``)."""
    conf = dict(cluster.spark_conf(), master=cluster.master_url)
    env = dict(os.environ, SPARK_LOCAL_IP=cluster.driver_ip, PYSPARK_PYTHON=sys.executable)
    out = open(os.path.join(workdir, "driver.out"), "w")
    err = open(os.path.join(workdir, "driver.err"), "w")
    return subprocess.Popen([sys.executable, "-c", script, json.dumps(conf), *args], env=env, stdout=out, stderr=err)


def _result(proc, workdir, timeout=600):
    """Waits for a driver started by `_start_driver` and returns what it emitted."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with open(os.path.join(workdir, "driver.out")) as f:
        stdout = f.read()
    with open(os.path.join(workdir, "driver.err")) as f:
        stderr = f.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _drive(cluster, script, *args, workdir, timeout=600):
    """Runs a driver script in a fresh process on the bridge; returns what it emitted."""
    return _result(_start_driver(cluster, script, *args, workdir=workdir), workdir, timeout)


@pytest.fixture(scope="module", params=["shared", "own"])
def cluster(request, tmp_path_factory):
    c = netns_cluster.NetnsCluster(
        hosts=2, hostnames=request.param, workdir=str(tmp_path_factory.mktemp(f"netns-{request.param}"))
    )
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_allreduce_across_two_hosts(cluster, tmp_path):
    results = _drive(cluster, ALLREDUCE, workdir=tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [3.0] and r["gathered"] == [0, 1] for r in results)
    # One rank per host, each host its own: not merged even when both have the same hostname.
    assert sorted(r["host"] for r in results) == ["10.77.0.2", "10.77.0.3"]
    assert all(r["local_size"] == 1 and r["cross_size"] == 2 for r in results)
    if cluster.hostnames == "shared":
        assert results[0]["hostname"] == results[1]["hostname"]
    else:
        assert sorted(r["hostname"] for r in results) == ["hvd-h2", "hvd-h3"]


def test_mpi_allreduce_across_two_hosts_without_ssh(cluster, tmp_path):
    """backend="mpi": mpirun on rank 0's task starts the other host's daemon through that host's
    barrier task (hvd_spark's rsh agent); the ranks talk MPI, one per host."""
    results = _drive(cluster, ALLREDUCE, "mpi", workdir=tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["mpi"] and not r["gloo"] for r in results)
    assert all(r["size"] == 2 and r["sum"] == [3.0] and r["gathered"] == [0, 1] for r in results)
    assert all(r["local_size"] == 1 and r["cross_size"] == 2 for r in results)
    # Each rank ran on its own host, from that host's task's work folder.
    assert results[0]["host"] != results[1]["host"]
    assert all(_rank_processes(ns, "orted") == [] for ns in ("hvd-h2", "hvd-h3"))


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)  # once: on the shared-hostname set-up
def test_mpi_rank_failing_on_the_remote_host_is_reported_and_stops_the_job(cluster, tmp_path):
    out = _drive(cluster, MPI_FAILURE, workdir=tmp_path, timeout=300)
    # The error names the host the rank really ran on (its task's, not mpirun's).
    host = out["host"]
    assert out["type"] == "ValueError" and out["rank"] == 1 and host in ("10.77.0.2", "10.77.0.3"), out
    assert f"rank 1 on host {host} failed with ValueError: rank 1 gives up on {host}" in out["error"], out
    # Rank 0 (asleep for 600 s) was stopped, and no daemon or rank is left on either host.
    for ns in ("hvd-h2", "hvd-h3"):
        assert _rank_processes(ns) == [] and _rank_processes(ns, "orted") == []


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
# Once, on the harder set-up (both hosts share a loopback hostname).
@pytest.mark.parametrize("cluster", ["shared"], indirect=True)
def test_fit_and_transform_across_two_hosts(cluster, tmp_path, backend):
    out = _drive(cluster, FIT, str(tmp_path / "store"), backend, workdir=tmp_path)
    assert sorted(out["hosts"]) == ["10.77.0.2", "10.77.0.3"]
    assert len(set(out["digests"])) == 1  # identical weights on both hosts
    assert out["accuracy"] >= 0.9, out


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)  # once: on the shared-hostname set-up
def test_host_lost_mid_epoch_then_training_finishes_when_it_returns(cluster, tmp_path):
    """Host 10.77.0.3's Worker, executor and rank are killed mid-epoch 2; the host comes back; the fit
    restarts from the epoch-1 checkpoint and ends with exactly 4 epochs on both hosts."""
    marker = tmp_path / "held"
    proc = _start_driver(cluster, HOSTLOSS, str(tmp_path / "store"), str(marker), "180", workdir=tmp_path)
    _wait_for(marker, proc, tmp_path)
    killed_at = time.time()
    cluster.kill_host(3)
    time.sleep(3)
    cluster.start_worker(3)  # the host returns
    out = _result(proc, tmp_path)
    assert "error" not in out, out
    assert out["restarts"] == 1
    # The restart names the lost rank's host and what happened to it.
    assert any("on host 10.77.0.3 failed with TaskLost" in line for _, line in out["log"]), out["log"]
    assert out["epochs"] == 4 and out["checkpoints"] == [1, 2, 3, 4]
    assert len(set(out["digests"])) == 1 and sorted(out["hosts"]) == ["10.77.0.2", "10.77.0.3"]
    for t, line in out["log"]:
        print(f"{t - killed_at:+7.1f} s  {line}")
    print(
        f"host loss: failure seen {out['failed_at'] - killed_at:.1f} s after the kill, restart logged "
        f"{out['restart_at'] - killed_at:.1f} s after, fit finished {out['finished_at'] - killed_at:.1f} s after"
    )


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)  # once: on the shared-hostname set-up
def test_elastic_fit_goes_on_without_a_lost_host_and_grows_when_it_returns(cluster, tmp_path):
    """The same loss mid-epoch 2 with min_num_proc=1: the fit goes on at once on the host left, from its
    commit inside the epoch; once that one-rank attempt has made a commit the host returns, and the fit
    grows back to both hosts at the next epoch end."""
    marker = tmp_path / "held"
    store = tmp_path / "store"
    proc = _start_driver(cluster, HOSTLOSS, str(store), str(marker), "180", "elastic", workdir=tmp_path)
    _wait_for(marker, proc, tmp_path)
    killed_at = time.time()
    cluster.kill_host(3)
    ckpts = store / "runs" / "hostloss" / "checkpoints"
    before = set(os.listdir(ckpts))
    deadline = time.monotonic() + 300
    while not {n for n in os.listdir(ckpts) if n.endswith(".json")} - before:  # the one-rank attempt commits
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.err").read_text()[-5000:]
        time.sleep(0.2)
    cluster.start_worker(3)  # the host returns
    out = _result(proc, tmp_path)
    assert "error" not in out, out
    kinds = [(r["kind"], r["from_size"], r["to_size"]) for r in out["recoveries"]]
    assert kinds == [("shrink", 2, 1), ("grow", 1, 2)], out["recoveries"]
    assert out["recoveries"][0]["resumed_from"].startswith("epoch 1 step "), out["recoveries"]
    assert out["recoveries"][0]["lost_hosts"] == ["10.77.0.3"]
    assert out["epochs"] == 10 and out["checkpoints"][-1] == 10
    assert len(set(out["digests"])) == 1 and sorted(out["hosts"]) == ["10.77.0.2", "10.77.0.3"]
    for r in out["recoveries"]:
        print(f"recovery {r['kind']}: {r['seconds']} s to the next first step, {r['steps_redone']} steps redone")
    print(f"elastic host loss: fit finished {out['finished_at'] - killed_at:.1f} s after the kill")


def _wait_for(marker, proc, workdir, timeout=300):
    """Waits until the driver's job has written ``marker`` (and is still running)."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (workdir / "driver.err").read_text()[-5000:]
        time.sleep(0.2)


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)  # once: on the shared-hostname set-up
def test_host_lost_for_good_fails_the_restart_naming_the_host(cluster, tmp_path):
    """The same loss, but the host does not come back: the restarted attempt cannot get its slots and
    fails after start_timeout, naming the lost host."""
    marker = tmp_path / "held"
    proc = _start_driver(cluster, HOSTLOSS, str(tmp_path / "store"), str(marker), "45", workdir=tmp_path)
    try:
        _wait_for(marker, proc, tmp_path)
        killed_at = time.time()
        cluster.kill_host(3)
        out = _result(proc, tmp_path)
        assert out["type"] == "JobTimeoutError", out
        assert "did not start within start_timeout=45s" in out["error"], out
        assert "lost host(s) ['10.77.0.3']" in out["error"], out
        print(f"host lost for good: fit failed {out['failed_at'] - killed_at:.1f} s after the kill: {out['error']}")
    finally:
        cluster.start_worker(3)  # back for the next test
        cluster.wait_for_workers(2, 120)


def _rank_processes(ns, marker="hvd_spark._internal.rank.entry"):
    """Processes in namespace ``ns`` whose command line holds ``marker`` (default: hvd_spark's ranks:
    fresh ones by their command line, those forked by a warm server by their name)."""
    from hvd_spark._internal.task.barrier import RANK_NAME

    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # exited meanwhile
        if marker.encode() in cmdline or (marker == "hvd_spark._internal.rank.entry" and comm == RANK_NAME):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)  # once: on the shared-hostname set-up
def test_host_that_stops_answering_is_named_and_nothing_hangs(cluster, tmp_path):
    """Host 10.77.0.3's link goes down mid-job (its packets dropped, its processes alive): the
    driver names the host and rank within the heartbeat timeout, and the cut-off host stops its rank."""
    marker = tmp_path / "running"
    proc = _start_driver(cluster, DROPPED, str(marker), workdir=tmp_path)
    try:
        _wait_for(marker, proc, tmp_path)
        assert _rank_processes("hvd-h3")
        dropped_at = time.time()
        subprocess.run(["ip", "-n", "hvd-h3", "link", "set", "eth0", "down"], check=True)
        out = _result(proc, tmp_path, timeout=300)
        detected = out["failed_at"] - dropped_at
        assert out["type"] == "HostUnreachable" and out["host"] == "10.77.0.3", out
        rank = int(marker.read_text())
        assert out["rank"] == rank and f"rank {rank} on host 10.77.0.3" in out["error"], out
        # Heartbeat timeout (30 s) + the other ranks' abort grace (10 s) + cancelling the Spark job.
        assert detected < 90, out
        # The cut-off host stops its own rank once the driver has been silent for the heartbeat timeout.
        deadline = time.monotonic() + 40
        while _rank_processes("hvd-h3") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _rank_processes("hvd-h3") == []
        print(f"dropped host: error raised {detected:.1f} s after the link went down: {out['error']}")
    finally:
        subprocess.run(["ip", "-n", "hvd-h3", "link", "set", "eth0", "up"], check=False)
        proc.kill()
