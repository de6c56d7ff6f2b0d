"""The digits example's fit and transform through Spark Connect against the same on a classic
session, side by side in one script (same data, model, epochs, ``local[2]`` on both sides).

The classic side runs first in this process; the Connect side talks to a local Connect server in its
own process (tests/connect_server.py), so its times include the gRPC hops and the store polling
that replace the driver's TCP service, but not a network between client and cluster.

    python -m benchmarks.bench_connect [--quick]
"""

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "tests")]

from benchmarks.common import cli, session, stats, write  # noqa: E402

EPOCHS = 6


def _measure(spark, store: str, repeats: int) -> dict:
    import keras
    from digits import digits_frames, digits_model

    import hvd_spark

    train, test = digits_frames(spark)
    fits, transforms, accuracy = [], [], []
    for i in range(repeats):
        keras.utils.set_random_seed(1)
        est = hvd_spark.HorovodEstimator(
            num_proc=2, store=store, model=digits_model(), optimizer=keras.optimizers.Adam(0.01),
            loss="sparse_categorical_crossentropy", feature_cols=["features"], label_cols=["label"],
            batch_size=32, epochs=EPOCHS, verbose=0, run_id=f"bench-{i}",
        )  # fmt: skip
        t = time.perf_counter()
        model = est.fit(train)
        fits.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = model.transform(test).select("label", "prediction").toPandas()
        transforms.append(time.perf_counter() - t)
        accuracy.append(float((out["label"] == out["prediction"]).mean()))
    return {"fit_s": stats(fits), "transform_s": stats(transforms), "accuracy": accuracy}


def main(quick: bool) -> None:
    repeats = 2 if quick else 3
    work = tempfile.mkdtemp(prefix="bench-connect-")
    spark = session("local[2]")
    classic = _measure(spark, os.path.join(work, "classic"), repeats)
    spark.stop()

    from connect_server import connect_server
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # what SparkSession.builder.remote sets
    with connect_server("local[2]", local_dir=os.path.join(work, "server")) as url:
        remote = RemoteSparkSession.builder.remote(url).getOrCreate()
        connect = _measure(remote, os.path.join(work, "connect"), repeats)
        remote.stop()
    data = {
        "what": f"digits fit ({EPOCHS} epochs, 2 ranks) and transform of the held-out rows, local[2]",
        "classic": classic,
        "connect": connect,
        "ratio_fit_connect_over_classic": connect["fit_s"]["median"] / classic["fit_s"]["median"],
        "ratio_transform_connect_over_classic": connect["transform_s"]["median"] / classic["transform_s"]["median"],
    }
    print(write("connect", data))
    for side in ("classic", "connect"):
        d = data[side]
        print(
            f"{side:8s} fit {d['fit_s']['median']:.1f}s  transform {d['transform_s']['median']:.1f}s  "
            f"accuracy {d['accuracy']}"
        )
    print(
        f"Connect / classic: fit {data['ratio_fit_connect_over_classic']:.2f}, "
        f"transform {data['ratio_transform_connect_over_classic']:.2f}"
    )


if __name__ == "__main__":
    cli(main)
