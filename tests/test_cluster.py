"""hvd_spark.run on local-cluster: two executor JVMs, ranks started from separate executors.

A SparkContext per process only, so the run happens in a fresh Python process.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

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


def test_allreduce_on_local_cluster(tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    _check_allreduce_script(SCRIPT, env, tmp_path)


def _check_allreduce_script(script, env, cwd):
    """Runs SCRIPT in a fresh process and checks: right sums, ordered ranks, two executors."""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(lines[-1][len("RESULT ") :])
    assert [r["rank"] for r in data["results"]] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [3.0] for r in data["results"])
    # The barrier tasks ran in two different executors.
    assert len(set(data["executors"])) == 2, data["executors"]


def _free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_allreduce_on_standalone_cluster(tmp_path):
    """A real standalone cluster (Master + Worker JVMs from the pip package's spark-class) on loopback."""
    import signal
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
        time.sleep(3)
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
            f'"1g", "spark.executor.cores": "1", "spark.cores.max": "2"}})',
        )
        _check_allreduce_script(script, env, tmp_path)  # two executor JVMs on the worker
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(30)
