"""hvd_spark.run on local-cluster: two executor JVMs, ranks started from separate executors.

A SparkContext per process only, so the run happens in a fresh Python process.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import run_result_script  # noqa: E402

pytestmark = pytest.mark.cluster

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import hvd_spark

    def job():
        import horovod.tensorflow as hvd
        import tensorflow as tf
        hvd.init()
        s = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy().tolist()
        return {"rank": hvd.rank(), "size": hvd.size(), "sum": s, "ppid_chain": os.getppid()}

    spark = hvd_spark.local_session("local-cluster[2,1,1024]", conf={"spark.executor.memory": "1g"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        executors = spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(
            lambda _: [os.environ.get("SPARK_EXECUTOR_ID", os.getppid())]).collect()
        out = hvd_spark.run(job, num_proc=2, verbose=0)
        print("RESULT " + json.dumps({"results": out, "executors": [str(e) for e in executors]}))
    finally:
        spark.stop()
""")


# Inserted into SCRIPT's try block for the standalone cluster: the slot count right after the session
# started, and a launch of more ranks than slots (refused before any task starts, not after start_timeout).
SLOTS_CHECK = textwrap.indent(
    textwrap.dedent("""
        import time
        from hvd_spark._internal.driver.options import resolve_launch_options
        default_num_proc = resolve_launch_options(spark, num_proc=None).num_proc
        t = time.monotonic()
        try:
            hvd_spark.run(job, num_proc=3, verbose=0, start_timeout=60)
            over = None
        except Exception as e:
            over = f"{type(e).__name__}: {e}"
        slots = {"default_parallelism": spark.sparkContext.defaultParallelism, "default_num_proc": default_num_proc,
                 "over": over, "over_seconds": time.monotonic() - t}
    """),
    "    ",
)


def test_allreduce_on_local_cluster(tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    _check_allreduce_script(SCRIPT, env, tmp_path)


def _check_allreduce_script(script, env, cwd):
    """Runs SCRIPT in a fresh process and checks: right sums, ordered ranks, two executors."""
    data = run_result_script(script, cwd=cwd, env=env)
    assert [r["rank"] for r in data["results"]] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [3.0] for r in data["results"])
    # The barrier tasks ran in two different executors.
    assert len(set(data["executors"])) == 2, data["executors"]
    return data


def _free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_allreduce_on_standalone_cluster(tmp_path):
    """A real standalone cluster (Master + Worker JVMs from the pip package's spark-class) on loopback.

    Its one Worker has 2 cores and the application sets spark.default.parallelism=8: the
    slots are those of the executors that registered (2), not 8. num_proc defaults to them, right
    after the session starts (hvd_spark waits for the executors), and num_proc=3 is refused within
    seconds with the numbers in the message, far within start_timeout.
    """
    import contextlib
    import signal
    import socket
    import time

    import pyspark

    home = os.path.dirname(pyspark.__file__)
    spark_class = os.path.join(home, "bin", "spark-class")
    env = dict(
        os.environ,
        SPARK_HOME=home,
        PYSPARK_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_WORKER_DIR=str(tmp_path / "work"),
        SPARK_LOG_DIR=str(tmp_path / "logs"),
    )
    port = _free_port()
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--webui-port",
                    str(_free_port()),
                ],
                env=env,
                stdout=open(tmp_path / "master.log", "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 120
        while True:  # the Master accepts Workers once its port is open
            assert procs[0].poll() is None, (tmp_path / "master.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the standalone Master did not open its port within 120 s"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        procs.append(
            subprocess.Popen(
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    f"spark://127.0.0.1:{port}",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "2",
                    "--memory",
                    "2g",
                    "--webui-port",
                    str(_free_port()),
                ],
                env=env,
                stdout=open(tmp_path / "worker.log", "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        script = SCRIPT.replace(
            'hvd_spark.local_session("local-cluster[2,1,1024]", conf={"spark.executor.memory": "1g"})',
            f'hvd_spark.local_session("spark://127.0.0.1:{port}", conf={{"spark.executor.memory": '
            f'"1g", "spark.executor.cores": "1", "spark.cores.max": "2", "spark.default.parallelism": "8"}})',
        )
        script = script.replace("\ntry:\n", "\ntry:\n" + SLOTS_CHECK, 1).replace(
            '"executors": [str(e) for e in executors]}', '"executors": [str(e) for e in executors], "slots": slots}'
        )
        data = _check_allreduce_script(script, env, tmp_path)  # two executor JVMs on the worker
        slots = data["slots"]
        assert slots["default_parallelism"] == 8
        assert slots["default_num_proc"] == 2, slots
        assert slots["over"] is not None and slots["over"].startswith("ValueError: "), slots
        for part in ("task slots (2)", "num_proc=3", "2 executors registered", "2 task slots", "spark.task.cpus=1"):
            assert part in slots["over"], (part, slots["over"])
        # A ValueError, not the JobTimeoutError that waiting start_timeout (60 s) for slots would end in:
        # refused at once (its time is printed in slots["over_seconds"]; speed is not asserted here).
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(30)


SPLIT_SCRIPT = textwrap.dedent("""
    import json, sys
    import hvd_spark
    from hvd_spark import Store
    from hvd_spark._internal.data import materialize as data_mod
    from hvd_spark._internal.data.identity import data_identity, dataset_key
    from hvd_spark._internal.common.specs import with_stored_names
    from pyspark.sql import functions as F

    spark = hvd_spark.local_session("local-cluster[2,1,1024]", conf={"spark.executor.memory": "1g"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        calls = spark.sparkContext.accumulator(0)

        def counted(x):
            calls.add(1)
            return float(x)

        counted_udf = F.udf(counted, "double")
        n = 20000
        df = (
            spark.range(n, numPartitions=4)
            .withColumn("k", (F.col("id") * 7919) % 13)
            .repartition(6, "k")  # a shuffle upstream: row order in partitions differs between evaluations
            .withColumn("x", F.array(counted_udf("id"), F.col("k").cast("double")))
            .withColumn("y", (F.col("id") % 2).cast("double"))
        )
        f, l = with_stored_names([data_mod.column_info(df, "x", "feature")], [data_mod.column_info(df, "y", "label")])
        prepared = data_mod.prepare(df, f, l, None, 0.3, seed=3)
        identity = data_identity(df)
        key = dataset_key(prepared, f + l, 0.3, 3, identity)
        meta = data_mod.materialize(prepared, Store(sys.argv[1]), key, f + l, 12, 2, files=4)
        ids = {}
        for split in ("train", "val"):
            paths = [p for p, _ in meta[split + "_files"]]
            rows = spark.read.parquet(*paths).select(F.col(f[0].stored)[0].alias("id")).collect()
            ids[split] = [int(r["id"]) for r in rows]
        print("RESULT " + json.dumps({"ids": ids, "calls": calls.value, "meta": {
            k: meta[k] for k in ("train_rows", "val_rows")}, "stats_rows": meta["stats"]["rows"],
            "established": identity.established, "reason": identity.reason}))
    finally:
        spark.stop()
""")


@pytest.mark.slow  # 50 s; the local[2] split tests stay in CI
def test_split_after_a_shuffle_on_local_cluster_evaluates_the_input_once(tmp_path):
    """On two executor JVMs, after a shuffle, the validation split neither shares nor loses rows, the
    upstream (a Python UDF counted by an accumulator) runs once per row, and the metadata counts the rows
    of the files written. Before: the split flag was F.rand over three evaluations of the input (stats,
    train write, val write): half the validation rows were also in training, 15% were in neither."""
    data = run_result_script(SPLIT_SCRIPT, str(tmp_path / "store"), cwd=tmp_path)
    train, val = data["ids"]["train"], data["ids"]["val"]
    assert len(train) == len(set(train)) and len(val) == len(set(val))  # no row written twice
    assert not set(train) & set(val)  # no row in both splits
    assert set(train) | set(val) == set(range(20000))  # none lost
    assert 0.27 < len(val) / 20000 < 0.33
    assert data["meta"] == {"train_rows": len(train), "val_rows": len(val)} and data["stats_rows"] == 20000
    assert data["calls"] == 20000, f"the upstream UDF ran for {data['calls'] / 20000:.2f}x the rows"
    # A range with a Python UDF: its data is in the plan, so the identity holds (the UDF is deterministic).
    assert data["established"], data["reason"]


INPLACE_SCRIPT = textwrap.dedent("""
    import glob, json, os, sys
    import numpy as np
    import hvd_spark
    from pyspark.sql import functions as F
    sys.path.insert(0, {tests!r})
    from _helpers import xor_estimator
    from hvd_spark._internal.common import sources

    root, trace = sys.argv[1], sys.argv[2]
    spark = hvd_spark.local_session("local-cluster[2,1,1024]", conf={{
        "spark.executor.memory": "700m", "spark.executorEnv.HVD_SPARK_DATA_TRACE": trace}})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        # ids after a shuffle (their order in the files depends on the run), written as a table
        df = (spark.range(3000).repartition(5).withColumn("x", F.array(F.col("id").cast("float"), F.rand(1)))
              .withColumn("y", (F.col("id") % 2).cast("int")))
        df.write.parquet(root + "/t")
        est = xor_estimator(root + "/store", epochs=2, validation=0.2, shuffle=True, shuffle_buffer_size=300,
                            batch_size=32, materialize="never", verbose=0)
        model = est.fit(spark.read.parquet(root + "/t"))
        import pyarrow.parquet as pq
        val = []
        split = ("fraction", 0.2, 0)
        for path in sorted(glob.glob(root + "/t/part-*.parquet")):
            table = pq.read_table(path, columns=["id"])
            mask, _ = sources.split_mask(sources.TableSource((), split), "file:" + path, table, 0)
            val += np.asarray(table.column("id"))[mask].tolist()
        seen = {{}}
        for f in glob.glob(trace + "/*.jsonl"):
            for line in open(f):
                r = json.loads(line)
                seen.setdefault(r["epoch"], []).extend(int(i) for i in r["ids"])
        print("RESULT " + json.dumps({{"val": val, "seen": seen, "history": model.getHistory(),
                                      "steps": model.getFitSummary().steps_per_epoch}}))
    finally:
        spark.stop()
""")


def test_a_table_read_in_place_on_local_cluster_trains_each_row_once_per_epoch(tmp_path):
    """Two executor JVMs read a shuffled table's own files (no copy): in every epoch each training row is
    read once by one rank (at most num_proc - 1 left out, rotating), no validation row is trained on, and
    the validation split is the one the file names and row numbers give."""
    script = INPLACE_SCRIPT.format(tests=os.path.dirname(__file__))
    data = run_result_script(script, str(tmp_path), str(tmp_path / "trace"), cwd=tmp_path)
    val = set(data["val"])
    assert 0.17 < len(val) / 3000 < 0.23
    train = set(range(3000)) - val
    for epoch, ids in data["seen"].items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a row read twice"
        assert not set(ids) & val, f"epoch {epoch}: validation rows trained on"
        assert len(train - set(ids)) <= 1, f"epoch {epoch}: {len(train - set(ids))} training rows not read"
    assert sorted(data["seen"]) == ["0", "1"] and len(data["history"]["val_loss"]) == 2


TRANSFORM_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import psutil
    import hvd_spark
    from pyspark.sql import functions as F
    sys.path.insert(0, {tests!r})
    from _helpers import xor_estimator
    from hvd_spark._internal.infer.remote import INFER_NAME
    from hvd_spark._internal.task.barrier import RANK_NAME

    def infer_children():
        servers = {{p.pid for p in psutil.process_iter(["cmdline", "name"])
                   if "hvd_spark._internal.task.warm" in " ".join(p.info["cmdline"] or [])
                   and p.info["name"] not in (RANK_NAME, INFER_NAME)}}
        return {{p.pid: p.info["ppid"] in servers for p in psutil.process_iter(["name", "ppid"])
                if p.info["name"] == INFER_NAME}}

    spark = hvd_spark.local_session("local-cluster[2,1,1024]", conf={{"spark.executor.memory": "800m"}})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        # features drawn anew at every evaluation, after a shuffle: only a row's own values can be compared
        df = (spark.range(3000).repartition(5, "id").withColumn("x", F.array(F.rand(), F.rand()))
              .withColumn("y", (F.col("id") % 2).cast("float")))
        model = xor_estimator(sys.argv[1], epochs=1, verbose=0).fit(df)
        keras_model = model.getModel()

        def checked():
            rows = model.transform(df.repartition(3)).select("id", "x", model.getOutputCols()[0]).collect()
            x = np.array([r["x"] for r in rows], np.float32)
            got = np.array([r[2] for r in rows], np.float64).reshape(len(rows), -1)
            want = keras_model.predict(x, verbose=0).reshape(len(rows), -1)
            return {{"rows": len(rows), "ids": len({{r["id"] for r in rows}}),
                    "max_diff": float(np.max(np.abs(got - want)))}}

        first = checked()
        children = infer_children()
        for pid in children:
            psutil.Process(pid).kill()
        second = checked()
        print("RESULT " + json.dumps({{"first": first, "second": second, "children": list(children.values())}}))
    finally:
        spark.stop()
""")


def test_a_transform_on_local_cluster_predicts_in_the_executors_warm_children(tmp_path):
    """Two executor JVMs, a shuffle upstream, features drawn anew at each evaluation: after the fit,
    transform's workers predict in children of the executors' warm servers (no TensorFlow import in
    the workers), every row's prediction is the model's for that row's own features, and once the
    children are killed the next transform still predicts every row (the model is loaded again)."""
    script = TRANSFORM_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    data = run_result_script(script, str(tmp_path / "store"), cwd=tmp_path)
    assert data["children"] and all(data["children"]), "no inference process forked by a warm server"
    for run in ("first", "second"):
        assert data[run]["rows"] == data[run]["ids"] == 3000, data[run]
        assert data[run]["max_diff"] < 1e-5, data[run]


LAYOUT_SCRIPT = textwrap.dedent("""
    import json, os, urllib.request
    os.environ["HVD_SPARK_RANK_LAYOUT"] = "host"  # run's own default is one rank per slot
    import hvd_spark

    def job():
        import horovod.tensorflow as hvd
        hvd.init()
        return {"rank": hvd.rank(), "size": hvd.size(), "threads": os.environ.get("HVD_SPARK_NUM_THREADS")}

    conf = {"spark.executor.memory": "1g", "spark.ui.enabled": "true", "spark.ui.port": "0"}
    spark = hvd_spark.local_session("local-cluster[1,2,1024]", conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        host = hvd_spark.run(job, verbose=0)
        split = hvd_spark.run(job, num_proc=2, verbose=0)
        sc = spark.sparkContext
        url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/stages"
        stages = json.load(urllib.request.urlopen(url, timeout=30))
        ranks = [s for s in stages if "Horovod ranks" in s.get("description", "")]
        profiles = sorted({(s["numTasks"], s["resourceProfileId"]) for s in ranks})
        print("RESULT " + json.dumps({"host": host, "split": split, "profiles": profiles}))
    finally:
        spark.stop()
""")


def test_the_host_layout_gives_a_rank_all_of_its_executors_cores(tmp_path):
    """One executor of 2 cores, spark.task.cpus=1: the host layout runs one rank with 2 threads whose
    barrier task asked for 2 CPUs (a TaskResourceProfile, not the default profile 0); num_proc=2 runs
    two ranks of one core each in the default profile."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    data = run_result_script(LAYOUT_SCRIPT, cwd=tmp_path, env=env)
    assert data["host"] == [{"rank": 0, "size": 1, "threads": "2"}]
    assert [(r["size"], r["threads"]) for r in data["split"]] == [(2, "1"), (2, "1")]
    (one, custom), (two, default) = data["profiles"]
    assert (one, two, default) == (1, 2, 0) and custom != 0, data["profiles"]
