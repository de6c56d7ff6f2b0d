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
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(lines[-1][len("RESULT "):])
    assert [r["rank"] for r in data["results"]] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == [3.0] for r in data["results"])
    # The barrier tasks ran in two different executors.
    assert len(set(data["executors"])) == 2, data["executors"]
