"""Inference: TFTransformer.transform rows/s on local[2] against single-process model.predict on
the same rows in memory, Spark's predict_batch_udf, and a row-at-a-time mapPartitions predictor
(the way horovod's KerasModel predicts). Sweeps the Arrow batch size.

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


def predict_in_process(path, rows, repeats):
    """Single-process model.predict in a fresh process (its thread count set by the launcher)."""
    import keras

    x = np.random.default_rng(0).normal(size=(rows, WIDTH)).astype("float32")
    m = keras.models.load_model(path)
    m.predict(x[:2048], batch_size=1024, verbose=0)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.predict(x, batch_size=1024, verbose=0)
        out.append(rows / (time.perf_counter() - t0))
    return out


def _run(df):
    t0 = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def main(quick: bool):
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
            from hvd_spark._internal.infer.expressions import arrow_udfs_available

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
    }
    print(write("inference", out))
    return out


if __name__ == "__main__":
    cli(main)
