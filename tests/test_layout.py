"""The rank layout (issue 38): by default a fit trains one rank per host with TensorFlow's threads on
all its cores; ``HVD_SPARK_RANK_LAYOUT=slot`` (and ``hvd_spark.run``'s default) keeps one rank per
task slot. The cluster half (a TaskResourceProfile for the barrier stage) is in test_cluster.py."""

import json
import os
import sys

import cloudpickle
import keras
from _helpers import xor_estimator, xor_frame

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the callback travels by value


class RecordThreads(keras.callbacks.Callback):
    """Each rank writes the TensorFlow thread pools it trains with to ``<folder>/rank-<r>.json``."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def on_train_begin(self, logs=None):
        import tensorflow as tf

        with open(os.path.join(self.folder, f"rank-{os.environ['HVD_SPARK_RANK']}.json"), "w") as f:
            json.dump(
                {
                    "intra": tf.config.threading.get_intra_op_parallelism_threads(),
                    "inter": tf.config.threading.get_inter_op_parallelism_threads(),
                    "env": os.environ.get("HVD_SPARK_NUM_THREADS"),
                },
                f,
            )


def _fit_threads(spark, tmp_path, name, **params):
    folder = tmp_path / name
    folder.mkdir()
    model = xor_estimator(
        str(tmp_path / f"store-{name}"), epochs=1, verbose=0, callbacks=[RecordThreads(str(folder))], **params
    ).fit(xor_frame(spark, 64))
    return model.getFitSummary(), {p.name: json.loads(p.read_text()) for p in sorted(folder.iterdir())}


def test_a_fit_without_num_proc_trains_one_rank_on_all_of_the_hosts_cores(spark, tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_SPARK_RANK_LAYOUT", raising=False)
    summary, threads = _fit_threads(spark, tmp_path, "host", num_proc=None)
    assert len(summary.ranks) == 1
    assert threads == {"rank-0.json": {"intra": 2, "inter": 2, "env": "2"}}  # local[2]: both cores
    # num_proc=1 given: the same one rank on both cores (before, spark.task.cpus = 1 thread)
    summary, threads = _fit_threads(spark, tmp_path, "one", num_proc=1)
    assert len(summary.ranks) == 1 and threads["rank-0.json"]["intra"] == 2


def test_the_slot_layout_keeps_one_rank_per_core(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_SPARK_RANK_LAYOUT", "slot")
    summary, threads = _fit_threads(spark, tmp_path, "slot", num_proc=None)
    assert len(summary.ranks) == 2
    assert all(t == {"intra": 1, "inter": 1, "env": "1"} for t in threads.values()) and len(threads) == 2
