"""Sparse gradients of an Embedding table (issue 46): what 2 ranks send per step, and their step time, when
an ``Embedding``'s ``IndexedSlices`` gradient is gathered as it is (the default since commit 14457dd) against
the old path, which made it a dense tensor of the whole table and allreduced it (``sparse_as_dense=True``).

The model: int32 ids (:data:`IDS_PER_ROW` a row) -> ``Embedding(1_000_000, 64)`` (256 MB of float32) ->
mean pooling -> Dense(64, relu) -> Dense(1, sigmoid), binary cross-entropy, trained with Adam (the issue's
optimizer) and with plain SGD on synthetic ids drawn uniformly from the table, :data:`BATCH` rows per rank.
Two ranks on ``local[2]`` over Gloo, each one TF thread; one launch (``hvd_spark.run``) per optimizer and
mode, in three rounds (every other one in reverse order; ``--quick``: one round of fewer steps), after an
empty launch that has the session's warm server ready. In each rank: the model built from the same seed on
both ranks (the same initial weights, checked at the end), ``compile``,
``make_distributed(model.optimizer, sparse_as_dense=...)`` as hvd_spark's ranks do, then ``model.fit`` over
:data:`WARMUP` + ``steps`` batches; the step time is the interval between consecutive batch ends after the
warm-up, the slower rank's. After training, the optimizer's update alone (no collective) on gradients of
the mode's form, which splits a step into the update and the rest (communication, forward, backward).

Bytes per step, two ways: counted, by calling ``average_gradients`` once (eagerly, on one batch's
gradients) with Horovod's grouped allreduce / allgather wrapped to record the tensors handed to them
(what each rank contributes; the wire bytes follow from the ring algorithms: an allreduce of N bytes
sends 2(n-1)/n N per rank, an allgather of k bytes per rank sends (n-1) k); and measured, as the bytes
the rank process wrote (``wchar`` of ``/proc/self/io``: Gloo's TCP pairs write with ``writev``) over the
timed steps, divided by the steps. Also the rank's peak RSS (``ru_maxrss``).

    python -m benchmarks.bench_sparse_embedding [--quick]
"""

import os
import statistics
import sys
import time

import cloudpickle

from benchmarks.common import cli, session, stats, write

# The ranks run in fresh processes that cannot import this folder: ship this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TABLE_ROWS = 1_000_000
DIM = 64
BATCH = 256  # rows per rank and step
IDS_PER_ROW = 20
WARMUP = 3  # steps before the timed ones (the first traces the train step)
RANKS = 2
MODES = [("sparse", False), ("dense", True)]  # (label, sparse_as_dense)
OPTIMIZERS = ["adam", "sgd"]


def _model():
    import keras

    ids = keras.Input((IDS_PER_ROW,), dtype="int32", name="ids")
    x = keras.layers.Embedding(TABLE_ROWS, DIM, name="table")(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))


def _optimizer(name: str):
    import keras

    return keras.optimizers.Adam(1e-3) if name == "adam" else keras.optimizers.SGD(0.05)


def _wchar() -> int:
    """Bytes this process (all its threads) has passed to write / writev so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _vm_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _counted_bytes(model, x, y, sparse_as_dense: bool) -> dict:
    """Calls ``average_gradients`` on one batch's gradients with Horovod's grouped collectives wrapped to
    record the bytes each is handed (this rank's contribution)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvd_spark._internal.rank.optimizer import average_gradients

    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    recorded = {"allreduce": [], "allgather": []}
    originals = {"allreduce": hvd.grouped_allreduce, "allgather": hvd.grouped_allgather}

    def recording(kind):
        def collective(tensors, *args, **kwargs):
            recorded[kind] += [
                {"shape": list(t.shape), "dtype": t.dtype.name, "bytes": int(t.shape.num_elements() * t.dtype.size)}
                for t in tensors
            ]
            return originals[kind](tensors, *args, **kwargs)

        return collective

    hvd.grouped_allreduce, hvd.grouped_allgather = recording("allreduce"), recording("allgather")
    try:
        average_gradients(grads, sparse_as_dense=sparse_as_dense)
    finally:
        hvd.grouped_allreduce, hvd.grouped_allgather = originals["allreduce"], originals["allgather"]
    n = hvd.size()
    allreduce = sum(t["bytes"] for t in recorded["allreduce"])
    allgather = sum(t["bytes"] for t in recorded["allgather"])
    return {
        "tensors": recorded,
        "gradients": [
            {"variable": v.path, "kind": type(g).__name__, "rows": int(g.indices.shape[0])}
            if isinstance(g, tf.IndexedSlices)
            else {"variable": v.path, "kind": "dense"}
            for v, g in zip(model.trainable_variables, grads)
        ],
        "allreduce_bytes": allreduce,
        "allgather_bytes": allgather,
        "handed_bytes": allreduce + allgather,
        # what the ring algorithms send from each rank: reduce-scatter + allgather, and n - 1 blocks
        "wire_bytes": round(allreduce * 2 * (n - 1) / n + allgather * (n - 1)),
    }


def _update_alone(model, sparse_as_dense: bool, repeats: int = 5) -> list[float]:
    """Seconds of one optimizer update alone (the optimizer's own class: no collective), on gradients in the
    form this mode hands it: the table's as ``IndexedSlices`` of every rank's lookups, or as a dense tensor."""
    import numpy as np
    import tensorflow as tf

    from hvd_spark._internal.common.serde import plain_class

    variables = model.trainable_variables
    table = model.get_layer("table").embeddings
    ids = RANKS * BATCH * IDS_PER_ROW
    rows = tf.constant(np.random.default_rng(0).integers(0, TABLE_ROWS, ids, dtype=np.int32))
    lookups = tf.IndexedSlices(tf.fill([ids, DIM], 1e-6), rows, tf.constant([TABLE_ROWS, DIM]))
    table_grad = tf.convert_to_tensor(lookups) if sparse_as_dense else lookups
    grads = [table_grad if v is table else tf.zeros(v.shape) for v in variables]
    times = []
    with plain_class(model.optimizer) as opt:
        update = tf.function(lambda: opt.apply(grads, variables))
        update()
        for _ in range(repeats):
            t = time.perf_counter()
            update()
            opt.iterations.numpy()
            times.append(time.perf_counter() - t)
    return times


def rank_job(optimizer_name: str, sparse_as_dense: bool, steps: int) -> dict:
    """One rank: the model, one counted ``average_gradients``, then ``fit`` over ``WARMUP + steps`` batches."""
    import os
    import resource

    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_spark._internal.rank.optimizer import make_distributed

    threads = int(os.environ.get("HVD_SPARK_NUM_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    hvd.init()
    rss_before_model = _vm_rss_mib()
    keras.utils.set_random_seed(0)  # the same initial weights on both ranks and in both modes
    model = _model()
    model.compile(optimizer=_optimizer(optimizer_name), loss="binary_crossentropy", jit_compile=False)
    make_distributed(model.optimizer, sparse_as_dense=sparse_as_dense)

    rng = np.random.default_rng(100 + hvd.rank())  # each rank its own rows, the same in every mode
    total = WARMUP + steps
    x = rng.integers(0, TABLE_ROWS, (total * BATCH, IDS_PER_ROW), dtype=np.int32)
    y = rng.integers(0, 2, (total * BATCH, 1)).astype(np.float32)
    counted = _counted_bytes(model, x[:BATCH], y[:BATCH], sparse_as_dense)

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends, self.wchar = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.wchar.append(_wchar())

    clock = Clock()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    history = model.fit(ds, steps_per_epoch=total, epochs=1, verbose=0, callbacks=[clock])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the checksum's copies
    table = model.get_layer("table").embeddings.numpy().astype(np.float64)
    update_s = _update_alone(model, sparse_as_dense)
    return {
        "rank": hvd.rank(),
        "step_s": [float(d) for d in np.diff(clock.ends[WARMUP - 1 :])],
        "update_alone_s": update_s,
        "wchar_per_step": (clock.wchar[-1] - clock.wchar[WARMUP - 1]) / steps,
        "counted": counted,
        "rss_before_model_mib": rss_before_model,
        "peak_rss_mib": peak_rss,
        "loss": float(history.history["loss"][-1]),
        "table_sum": float(table.sum()),
        "table_norm": float(np.sqrt((table**2).sum())),
    }


def _noop() -> None:
    return None


def _summary(runs: list[list[dict]]) -> dict:
    """Pools a configuration's launches: per step the slower rank's interval; the rest per rank."""
    step = [max(ts) for run in runs for ts in zip(*(r["step_s"] for r in run))]
    first = runs[0]
    ranks = [r for run in runs for r in run]
    agree = all(len({(r["table_sum"], r["table_norm"]) for r in run}) == 1 for run in runs)
    return {
        "step_s": stats(step),
        "launch_median_step_s": [statistics.median(max(ts) for ts in zip(*(r["step_s"] for r in run))) for run in runs],
        "counted": first[0]["counted"],
        "wchar_per_step": stats([r["wchar_per_step"] for r in ranks]),
        "update_alone_s": stats([t for r in ranks for t in r["update_alone_s"]]),
        "rss_before_model_mib": max(r["rss_before_model_mib"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "ranks_agree": agree,  # the same table on every rank at the end (bitwise)
        "table_sum": first[0]["table_sum"],
        "table_norm": first[0]["table_norm"],
        "loss": [r["loss"] for r in ranks],
    }


def main(quick: bool):
    import hvd_spark

    steps, rounds = (8, 1) if quick else (20, 3)
    spark = session("local[2]")
    raw: dict = {(o, m): [] for o in OPTIMIZERS for m, _ in MODES}
    load = {"start": os.getloadavg()}  # other work on the machine, for the record
    try:
        hvd_spark.run(_noop, num_proc=RANKS, verbose=0)  # the session's first launch, its warm server ready
        for i in range(rounds):
            order = [(o, m, d) for o in OPTIMIZERS for m, d in MODES]
            for opt, label, dense in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                run = hvd_spark.run(rank_job, args=(opt, dense, steps), num_proc=RANKS, verbose=0)
                raw[(opt, label)].append(run)
                med = statistics.median(max(ts) for ts in zip(*(r["step_s"] for r in run)))
                print(f"{opt} {label}: step {med * 1e3:.1f} ms, launch {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        spark.stop()
    load["end"] = os.getloadavg()

    out: dict = {
        "table": {"rows": TABLE_ROWS, "dim": DIM, "bytes": TABLE_ROWS * DIM * 4},
        "batch_per_rank": BATCH,
        "ids_per_row": IDS_PER_ROW,
        "ranks": RANKS,
        "backend": "gloo",
        "threads_per_rank": 1,
        "warmup_steps": WARMUP,
        "timed_steps_per_launch": steps,
        "launches_per_configuration": rounds,
        "bytes_method": (
            "counted: average_gradients called once on one batch's gradients with hvd.grouped_allreduce / "
            "grouped_allgather wrapped to record the tensors handed to them (this rank's contribution); "
            "wire_bytes: what the ring algorithms send from each rank (allreduce 2(n-1)/n N, allgather (n-1) k); "
            "measured: the rank process's wchar (/proc/self/io) over the timed steps, per step"
        ),
        "load_average_1_5_15_min": load,
        "optimizers": {},
    }
    for opt in OPTIMIZERS:
        modes = {label: _summary(raw[(opt, label)]) for label, _ in MODES}
        sp, de = modes["sparse"], modes["dense"]
        out["optimizers"][opt] = {
            "modes": modes,
            "sparse_over_dense": {
                "step_time": sp["step_s"]["median"] / de["step_s"]["median"],
                "wire_bytes": sp["counted"]["wire_bytes"] / de["counted"]["wire_bytes"],
                "measured_bytes": sp["wchar_per_step"]["median"] / de["wchar_per_step"]["median"],
                "peak_rss": sp["peak_rss_mib"] / de["peak_rss_mib"],
            },
            # the two paths train the same model: the table after the same steps, relative difference
            "table_norm_rel_diff": abs(sp["table_norm"] - de["table_norm"]) / de["table_norm"],
        }
        r = out["optimizers"][opt]["sparse_over_dense"]
        print(opt, {k: round(v, 4) for k, v in r.items()}, flush=True)
    print(write("sparse_embedding", out))
    return out


if __name__ == "__main__":
    cli(main)
