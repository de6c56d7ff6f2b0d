"""End to end on scikit-learn's digits (1,797 8x8 images, 10 classes), the project's main job.

    .venv/bin/python examples/digits.py [--num-proc 2] [--epochs 12] [--store ./hvd_spark_store]

Fits a small convolutional network with 2 Horovod processes on local Spark, printing the
metrics of every epoch as they arrive, evaluates on a held-out split with transform(),
saves and loads the fitted model, and checks that the loaded one predicts the same.
"""

import argparse
import logging
import os
import shutil
import tempfile
import time


def digits_frames(spark, seed: int = 7):
    """Train and held-out test DataFrames: a 'features' array<float> column (64 pixels in [0, 1]) and 'label'."""
    import numpy as np
    import pandas as pd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)

    def frame(X, y):
        return spark.createDataFrame(pd.DataFrame({"features": list(X), "label": y.astype("int64")}))

    return frame(X_tr, y_tr), frame(X_te, y_te)


def digits_model():
    import keras

    inputs = keras.Input(shape=(8, 8, 1), name="pixels")
    x = keras.layers.Conv2D(16, 3, activation="relu", padding="same")(inputs)
    x = keras.layers.Conv2D(32, 3, activation="relu", padding="same")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    return keras.Model(inputs, outputs)


def _print_mlflow_run(run_id: str) -> None:
    """What the fit left in MLflow: params, tags, each metric's per-epoch history, the model."""
    import mlflow

    client = mlflow.MlflowClient()
    data = client.get_run(run_id).data
    print(f"MLflow run {run_id} ({mlflow.get_tracking_uri()}):")
    for k, v in sorted(data.params.items()):
        print(f"  param  {k} = {v}")
    for k, v in sorted(data.tags.items()):
        if k.startswith("hvd_spark."):
            print(f"  tag    {k} = {v}")
    for name in sorted(data.metrics):
        values = [f"{m.value:.4g}" for m in client.get_metric_history(run_id, name)]
        print(f"  metric {name}: {', '.join(values)}")
    for m in mlflow.search_logged_models(filter_string=f"source_run_id = '{run_id}'", output_format="list"):
        print(f"  model  {m.name}: {m.model_uri}")


def job_arguments(description: str) -> argparse.ArgumentParser:
    """The digits jobs' common options (this one's and ``torch_digits.py``'s)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--store", default=os.path.join(os.getcwd(), "hvd_spark_store"))
    return p


def job_session(a, app_name: str, prewarm: bool | int = True):
    """Logging for a person watching, and the local Spark session: ``--master``, with at least
    ``--num-proc`` task slots for ``local[*]`` on a machine with fewer cores; ``prewarm`` as
    ``hvd_spark.local_session``'s (the num_proc of the fits to come: their ranks' warm server)."""
    import hvd_spark

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("hvd_spark.rank").setLevel(logging.WARNING)  # ranks' own output: only problems
    master = a.master
    if master == "local[*]" and (os.cpu_count() or 1) < a.num_proc:
        master = f"local[{a.num_proc}]"
    spark = hvd_spark.local_session(master, app_name=app_name, prewarm=prewarm)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main():
    p = job_arguments(__doc__)
    p.add_argument("--run-id", default=None, help="default: a new run each time")
    p.add_argument(
        "--mlflow",
        default=None,
        metavar="URI",
        help="track the fit in MLflow at this tracking URI (e.g. sqlite:///mlflow.db; needs hvd_spark[mlflow])",
    )
    a = p.parse_args()
    import keras
    import numpy as np

    from hvd_spark import HorovodEstimator, TFTransformer

    spark = job_session(a, "hvd_spark-digits", prewarm=a.num_proc)
    try:
        train_df, test_df = digits_frames(spark)
        est = HorovodEstimator(
            num_proc=a.num_proc,
            store=a.store,
            model=digits_model(),
            optimizer=keras.optimizers.Adam(learning_rate=0.002),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            feature_cols=["features"],
            label_cols=["label"],
            validation=0.1,
            batch_size=a.batch_size,
            epochs=a.epochs,
            random_seed=1,
            run_id=a.run_id,
        )
        t0 = time.time()
        if a.mlflow:
            import mlflow

            mlflow.set_tracking_uri(a.mlflow)
            with mlflow.start_run(run_name="digits") as run:
                fitted = est.fit(train_df)
            _print_mlflow_run(run.info.run_id)
        else:
            fitted = est.fit(train_df)
        fit_s = time.time() - t0

        t0 = time.time()
        scored = fitted.transform(test_df).select("label", "label__output").toPandas()
        transform_s = time.time() - t0
        probs = np.stack(scored["label__output"].to_numpy())
        accuracy = float((probs.argmax(axis=1) == scored["label"].to_numpy()).mean())

        saved = tempfile.mkdtemp(prefix="hvd_spark-digits-model-")
        shutil.rmtree(saved)
        fitted.save(saved)
        reloaded = TFTransformer.load(saved)
        again = reloaded.transform(test_df).select("label__output").toPandas()
        same = bool(np.allclose(np.stack(again["label__output"].to_numpy()), probs, atol=1e-6))
        shutil.rmtree(saved, ignore_errors=True)

        history = fitted.getHistory()
        print(
            f"run {fitted.getRunId()}: {len(history['loss'])} epochs, final val_accuracy "
            f"{history['val_accuracy'][-1]:.4f}"
        )
        print(f"fit: {fit_s:.1f}s   transform of {len(scored)} rows: {transform_s:.1f}s")
        print(f"held-out accuracy: {accuracy:.4f}   saved/loaded model predicts the same: {same}")
        if accuracy < 0.9 or not same:
            raise SystemExit("digits example did not reach the expected quality")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
