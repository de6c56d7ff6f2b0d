"""Inference: TFTransformer.transform rows/s on local[2] against single-process model.predict on
the same rows in memory, Spark's predict_batch_udf, and a row-at-a-time mapPartitions predictor
(the way horovod's KerasModel predicts). Sweeps the Arrow batch size.

The protocol's section (``protocol``, issue 38): an MLP 32-256-256-1 (74,497 params) fitted on a
Parquet table of a 32-float array feature and a binary label, then 1M rows (200k with --quick) of that
table transformed to a noop sink after the fit (so the warm servers are up): the first transform
(cold: the Python workers load the model), then warm transforms alternated with Spark's
``predict_batch_udf`` on the same model and rows and with an Arrow UDF that returns zeros (what Spark
alone costs: scan, Arrow both ways, sink), and single-process ``model.predict`` on the same rows in
memory. Ratios against ``predict_batch_udf`` and ``model.predict`` come from the same run; the CPU
seconds of the JVM, the UDF workers and the warm servers' inference processes per transform say what
bounds it.

    python -m benchmarks.bench_inference [--quick]
"""

import os
import sys
import tempfile
import time

import cloudpickle
import numpy as np

from benchmarks.common import cli, session, stats, write

cloudpickle.register_pickle_by_value(sys.modules[__name__])

WIDTH = 64


def build_model(path):
    import keras

    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    m.save(path)
    return m


def frame(spark, rows):
    import pandas as pd

    x = np.random.default_rng(0).normal(size=(rows, WIDTH)).astype("float32")
    return spark.createDataFrame(pd.DataFrame({"features": list(x)})).repartition(2).cache(), x


def predict_in_process(path, rows, repeats, x=None, batch_size=1024):
    """Single-process model.predict (its thread count set by the launcher, else TF's default)."""
    import keras

    if x is None:
        x = np.random.default_rng(0).normal(size=(rows, WIDTH)).astype("float32")
    m = keras.models.load_model(path)
    m.predict(x[:2048], batch_size=batch_size, verbose=0)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.predict(x, batch_size=batch_size, verbose=0)
        out.append(rows / (time.perf_counter() - t0))
    return out


def _run(df):
    t0 = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


PROTO_WIDTH = 32


def protocol_model():
    """The protocol's model: an MLP 32-256-256-1 (74,497 params), a binary classifier."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((PROTO_WIDTH,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def protocol_table(folder, rows):
    """The protocol's Parquet table: ``x`` a 32-float array, ``y`` a binary label; 4 files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.random.default_rng(0).normal(size=(rows, PROTO_WIDTH)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("float32")
    os.makedirs(folder)
    for i in range(4):
        part = slice(i * rows // 4, (i + 1) * rows // 4)
        flat = pa.array(x[part].reshape(-1))
        feature = pa.FixedSizeListArray.from_arrays(flat, PROTO_WIDTH).cast(pa.list_(pa.float32()))
        pq.write_table(pa.table({"x": feature, "y": y[part]}), f"{folder}/part-{i}.parquet", row_group_size=1 << 17)
    return x


def _cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this machine's JVMs, Spark's Python workers and warm servers (with their
    inference processes), from /proc (Linux)."""
    out = {"jvm": 0.0, "udf_workers": 0.0, "warm_inference": 0.0}
    hz = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = (
            "jvm"
            if b"java" in cmd and b"spark" in cmd
            else "udf_workers"
            if b"pyspark.daemon" in cmd
            else "warm_inference"
            if b"hvd_spark._internal.task.warm" in cmd
            else None
        )
        if kind:
            out[kind] += (int(fields[11]) + int(fields[12])) / hz
    return out


def _run_cpu(df, rows):
    """(rows/s, CPU seconds per kind) of one run to the noop sink. Other users of the machine's
    JVMs count too: run it alone."""
    before = _cpu_by_kind()
    rate = rows / _run(df)
    after = _cpu_by_kind()
    return rate, {k: round(after[k] - before[k], 2) for k in after}


def protocol(spark, folder, quick):
    """The protocol's inference run (see the module's doc)."""
    from collections.abc import Iterator

    import keras
    import pyarrow as pa
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from hvd_spark import HorovodEstimator

    rows, repeats = (200_000, 3) if quick else (1_000_000, 5)
    x = protocol_table(os.path.join(folder, "table"), rows)
    table = spark.read.parquet(os.path.join(folder, "table"))
    est = HorovodEstimator(
        num_proc=2,
        store=os.path.join(folder, "store"),
        model=protocol_model(),
        optimizer=keras.optimizers.Adam(1e-3),
        loss="binary_crossentropy",
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=512,
        epochs=1,
        verbose=0,
    )
    model = est.fit(table.limit(50_000))
    url = model.getModelUrl()

    cold, cold_cpu = _run_cpu(model.transform(table), rows)

    def make_predict_fn():
        from hvd_spark._internal.infer.cache import load_uncached

        m = load_uncached(url, {}, None)
        return lambda v: m.predict_on_batch(v)

    pbu = predict_batch_udf(
        make_predict_fn, return_type=T.FloatType(), batch_size=1024, input_tensor_shapes=[[PROTO_WIDTH]]
    )

    def zeros(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        for b in batches:
            yield pa.array(np.zeros(len(b)))

    floor_udf = F.arrow_udf(zeros, returnType=T.DoubleType())  # type: ignore[call-overload]
    jobs = {
        "transform_warm": model.transform(table),
        "predict_batch_udf": table.withColumn("p", pbu("x")),
        "spark_floor_zeros_udf": table.withColumn("p", floor_udf(F.struct(table.x.alias("_f0")))),
    }
    for df in jobs.values():  # each Python worker loads its model once, before timing
        _run(df)
    rates: dict[str, list] = {k: [] for k in jobs}
    cpu: dict[str, list] = {k: [] for k in jobs}
    for _ in range(repeats):  # alternated: the machine's other load falls on each alike
        for k, df in jobs.items():
            rate, secs = _run_cpu(df, rows)
            rates[k].append(rate)
            cpu[k].append(secs)
    single = stats(predict_in_process(url.removeprefix("file://"), rows, repeats, x=x, batch_size=10_000))
    med = {k: stats(v) for k, v in rates.items()}
    cpu_median = {k: {kind: float(np.median([c[kind] for c in v])) for kind in v[0]} for k, v in cpu.items()}
    warm = med["transform_warm"]["median"]
    return {
        "rows": rows,
        "model": "MLP 32-256-256-1, 74,497 params, binary; fitted 1 epoch on 50k rows (num_proc=2)",
        "transform_cold_rows_per_s": cold,
        "transform_cold_cpu_s": cold_cpu,
        "rows_per_s": med,
        "cpu_s_per_run_median": cpu_median,
        "single_process_predict_rows_per_s": single,
        "ratio_transform_warm_over_predict_batch_udf": warm / med["predict_batch_udf"]["median"],
        "ratio_transform_warm_over_single_predict": warm / single["median"],
        "ratio_transform_warm_over_spark_floor": warm / med["spark_floor_zeros_udf"]["median"],
        "ratio_transform_cold_over_predict_batch_udf": cold / med["predict_batch_udf"]["median"],
    }


def main(quick: bool, only_protocol: bool = False):
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    from hvd_spark import TFTransformer

    rows = 100_000 if quick else 400_000
    row_rows = 2_000 if quick else 5_000
    repeats = 3
    batches = [1_000, 10_000] if quick else [1_000, 10_000, 50_000]
    spark = session("local[2]")
    out = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            proto = protocol(spark, os.path.join(d, "protocol"), quick)
            print(proto, flush=True)
            if only_protocol:
                return proto
            path = os.path.join(d, "model.keras")
            build_model(path)
            df, _ = frame(spark, rows)
            df.count()
            transformer = TFTransformer(
                model_url="file://" + path,
                feature_cols=["features"],
                output_cols=["p"],
                input_specs=[{"name": "x", "shape": [WIDTH], "dtype": "float32"}],
                output_specs=[{"name": "p", "shape": [10], "dtype": "float32"}],
            )

            def make_predict_fn():
                import keras

                m = keras.models.load_model(path)
                return lambda v: m.predict_on_batch(v)

            pbu = predict_batch_udf(
                make_predict_fn, return_type=T.ArrayType(T.FloatType()), batch_size=1024, input_tensor_shapes=[[WIDTH]]
            )

            def row_at_a_time(it):
                import keras

                m = keras.models.load_model(path)
                for row in it:
                    yield (m.predict_on_batch(np.asarray([row.features], dtype="float32"))[0].tolist(),)

            small = df.limit(row_rows).cache()
            small.count()
            sweep = {}
            for b in batches:
                spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(b))
                _run(transformer.transform(df))  # warm-up: the model loads once per Python worker
                sweep[b] = stats([rows / _run(transformer.transform(df)) for _ in range(repeats)])
            spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
            # The two UDF kinds of transform side by side (Arrow UDFs exist from pyspark 4.1).
            from hvd_spark._internal.ml.expressions import arrow_udfs_available

            kinds = ["arrow", "pandas"] if arrow_udfs_available() else ["pandas"]
            by_kind = {k: transformer.copy({transformer.inference_udf: k}) for k in kinds}
            for t in by_kind.values():
                _run(t.transform(df))
            kind_rates = {k: [] for k in kinds}
            for _ in range(repeats):  # interleaved
                for k, t in by_kind.items():
                    kind_rates[k].append(rows / _run(t.transform(df)))
            kind_s = {k: stats(v) for k, v in kind_rates.items()}
            _run(df.withColumn("p", pbu("features")))
            pbu_s = stats([rows / _run(df.withColumn("p", pbu("features"))) for _ in range(repeats)])
            row_s = stats([row_rows / _run(small.rdd.mapPartitions(row_at_a_time).toDF(["p"])) for _ in range(2)])
            single_s = stats(predict_in_process(path, rows, repeats))  # this process: TF's default threads
            import hvd_spark

            single_1t = stats(
                hvd_spark.run(predict_in_process, args=(path, rows, repeats), num_proc=1, num_threads=1, verbose=0)[0]
            )
    finally:
        spark.stop()
    best = max(sweep, key=lambda b: sweep[b]["median"])
    out = {
        "rows": rows,
        "row_at_a_time_rows": row_rows,
        "transform_rows_per_s_by_arrow_batch": {str(k): v for k, v in sweep.items()},
        "best_arrow_batch": best,
        "transform_rows_per_s_by_udf_at_10000": kind_s,
        "ratio_arrow_udf_over_pandas_udf": (
            kind_s["arrow"]["median"] / kind_s["pandas"]["median"] if "arrow" in kind_s else None
        ),
        "predict_batch_udf_rows_per_s": pbu_s,
        "row_at_a_time_rows_per_s": row_s,
        "single_process_predict_rows_per_s": single_s,
        "single_process_predict_1_thread_rows_per_s": single_1t,
        "ratio_transform_over_single_predict_1_thread": sweep[best]["median"] / single_1t["median"],
        "ratio_transform_over_single_predict": sweep[best]["median"] / single_s["median"],
        "ratio_transform_over_row_at_a_time": sweep[best]["median"] / row_s["median"],
        "ratio_transform_over_predict_batch_udf": sweep[best]["median"] / pbu_s["median"],
        "protocol": proto,
    }
    print(write("inference", out))
    return out


if __name__ == "__main__":
    if "--protocol-only" in sys.argv:  # the protocol's section alone, printed (no results file)
        sys.argv.remove("--protocol-only")
        cli(lambda quick: main(quick, only_protocol=True))
    else:
        cli(main)
