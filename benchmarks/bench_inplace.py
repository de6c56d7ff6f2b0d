"""A fit on a Parquet table: copied to the store first (``materialize="always"``, the baseline) against
read in place by the ranks (``materialize="never"``), side by side in one run, on tables of 1M and
10M rows.

Each fit starts on a fresh store (nothing to reuse) and trains one epoch of a small MLP (16 float
features as an array column, a regression label) on 2 ranks of ``local[2]``. Reported per table and
mode: seconds to the first training step (from ``fit``'s call to rank 0's first finished batch), the
whole fit, the data step (the copy, or the in-place scan for the statistics), and the bytes the store
holds afterwards (the copy, checkpoints, logs) against the table's own; and the ratios in place / copy.

    python -m benchmarks.bench_inplace [--quick]
"""

import os
import shutil
import tempfile
import time

import keras

from benchmarks.common import cli, session, write


class FirstStep(keras.callbacks.Callback):
    """Rank 0 writes the wall-clock time of its first finished batch to ``path``."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.done = path, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and os.environ.get("HVD_SPARK_RANK") == "0":
            self.done = True
            with open(self.path, "w") as f:
                f.write(repr(time.time()))


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _table(spark, path: str, rows: int) -> None:
    from pyspark.sql import functions as F

    df = spark.range(rows, numPartitions=8).withColumn(
        "x", F.array(*[F.sin(F.col("id") * (k + 1)).cast("float") for k in range(16)])
    )
    df.withColumn("y", F.cos("id")).drop("id").write.mode("overwrite").parquet(path)


def _fit(spark, table: str, store: str, mode: str, mark: str) -> dict:
    import hvd_spark

    inp = keras.Input((16,))
    out = keras.layers.Dense(1)(keras.layers.Dense(32, activation="relu")(inp))
    est = hvd_spark.HorovodEstimator(
        num_proc=2,
        store=store,
        model=keras.Model(inp, out),
        optimizer="adam",
        loss="mse",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=1024,
        epochs=1,
        materialize=mode,  # a fresh store: nothing to reuse; the copy stays in it, as after a user's fit
        callbacks=[FirstStep(mark)],
        verbose=0,
    )
    t0 = time.time()
    model = est.fit(spark.read.parquet(table))
    fit_s = time.time() - t0
    with open(mark) as f:
        first = float(f.read())
    s = model.getFitSummary()
    return {
        "first_step_s": first - t0,
        "fit_s": fit_s,
        "data_s": s.materialize_seconds,
        "store_bytes": _bytes(store),
        "steps_per_epoch": s.steps_per_epoch,
    }


def main(quick: bool = False) -> dict:
    sizes = [100_000, 1_000_000] if quick else [1_000_000, 10_000_000]
    spark = session("local[2]", spark_driver_memory="4g")
    out: dict = {"tables": {}, "ranks": 2, "epochs": 1, "batch_size": 1024}
    with tempfile.TemporaryDirectory() as tmp:
        warm = os.path.join(tmp, "warm")
        _table(spark, warm, 20_000)
        _fit(spark, warm, os.path.join(tmp, "warm-store"), "never", os.path.join(tmp, "mark"))  # warm servers
        for rows in sizes:
            table = os.path.join(tmp, f"t{rows}")
            _table(spark, table, rows)
            entry: dict = {"table_bytes": _bytes(table), "modes": {}}
            for mode, name in (("always", "copy"), ("never", "in_place")):
                store = os.path.join(tmp, f"store-{rows}-{name}")
                entry["modes"][name] = _fit(spark, table, store, mode, os.path.join(tmp, "mark"))
                shutil.rmtree(store, ignore_errors=True)
                print(rows, name, entry["modes"][name], flush=True)
            c, i = entry["modes"]["copy"], entry["modes"]["in_place"]
            entry["ratio_first_step"] = i["first_step_s"] / c["first_step_s"]
            entry["ratio_fit"] = i["fit_s"] / c["fit_s"]
            entry["ratio_store_bytes"] = i["store_bytes"] / max(1, c["store_bytes"])
            out["tables"][str(rows)] = entry
            shutil.rmtree(table, ignore_errors=True)
    spark.stop()
    path = write("inplace", out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    cli(main)
