"""horovod's own Spark Keras and PyTorch examples run on hvd_spark with only their import lines changed.

``tests/ports/`` holds ``examples/spark/keras/keras_spark_mnist.py``,
``keras_spark_rossmann_estimator.py`` and ``examples/spark/pytorch/pytorch_spark_mnist.py`` of horovod
v0.28.1 (horovod's sdist has no ``examples/``),
with the import lines (and Keras 3's ``lr=`` -> ``learning_rate=``) changed as each file's header
lists; ``tests/fast/test_horovod_ports_text.py`` checks that nothing else differs. Each example
runs as a user runs it, ``python <example> --master local[2] --num-proc 2 ...``, in its own process
(it makes its own session and stops it), on small generated input files of the real data's schemas
where it reads them (MNIST's LIBSVM file; Rossmann's seven CSV files), sized through its own
command-line arguments. The session fixture reads what the Rossmann run saved.
"""

import bz2
import csv
import datetime
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

PORTS = Path(__file__).parent / "ports"
# a rank's output line as the examples' SparkBackend(stdout=sys.stdout, prefix_output_with_timestamp=True)
# writes it: horovod's "{time.asctime()}[{rank}]<stdout>:{line}"
RANK_LINE = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[([01])\]<stdout>:(.*)$", re.MULTILINE)


def _run_example(name: str, *args: str, cwd: Path, timeout: float = 600) -> tuple[str, float]:
    out, _, took = _run_example_logged(name, *args, cwd=cwd, timeout=timeout)
    return out, took


def _run_example_logged(name: str, *args: str, cwd: Path, timeout: float = 600) -> tuple[str, str, float]:
    """The example's stdout, its stderr (hvd_spark's log lines) and how long it took."""
    env = dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(PORTS / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-8000:]
    return proc.stdout, proc.stderr, took


# --- MNIST ---------------------------------------------------------------------------------------


def _write_mnist_libsvm(path: Path, rows: int, seed: int = 0) -> None:
    """``mnist.bz2`` as the example downloads it (LIBSVM's "mnist": label, then 1-based pixel
    index:value pairs of the nonzero pixels, values 0-255): digit ``k`` is a bright 6x6 square at a
    place of its own, with faint noise pixels elsewhere."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        label = i % 10
        img = np.zeros((28, 28))
        r, c = 2 + (label // 5) * 13 + rng.integers(0, 3), 1 + (label % 5) * 5 + rng.integers(0, 2)
        img[r : r + 6, c : c + 4] = rng.integers(150, 256, size=(6, 4))
        noise = rng.integers(0, 784, size=20)
        img.flat[noise] = np.maximum(img.flat[noise], rng.integers(1, 60, size=20))
        flat = img.reshape(-1)
        pairs = " ".join(f"{j + 1}:{int(v)}" for j, v in enumerate(flat) if v > 0)
        lines.append(f"{label} {pairs}")
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def test_keras_spark_mnist_runs_with_only_its_imports_changed(tmp_path):
    _write_mnist_libsvm(tmp_path / "mnist.bz2", rows=600)
    out, took = _run_example(
        "keras_spark_mnist.py",
        "--master",
        "local[2]",
        "--num-proc",
        "2",
        "--batch-size",
        "32",
        "--epochs",
        "2",
        "--work-dir",
        str(tmp_path / "store"),
        "--data-dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    accuracy = float(re.search(r"^Test accuracy: ([0-9.]+)$", out, re.MULTILINE).group(1))
    print(f"mnist port: test accuracy {accuracy:.3f} (chance 0.1) in {took:.1f} s")
    assert accuracy > 0.8, out[-3000:]
    assert (tmp_path / "store" / "runs").is_dir()  # Store.create(args.work_dir) held the run


def test_pytorch_spark_mnist_runs_with_only_its_imports_changed(tmp_path):
    """horovod's PyTorch example: its ``Net`` (defined in ``__main__``), ``input_shapes=[[-1, 1, 28, 28]]``
    on the LIBSVM Vector column, its loss a lambda ``NLLLoss(input, target.long())`` on the double
    ``label`` column, ``validation=0.1``, ``--backward-passes-per-step``, then ``setOutputCols`` and its
    own argmax UDF and evaluator on the held-out rows."""
    pytest.importorskip("torch")
    import json

    _write_mnist_libsvm(tmp_path / "mnist.bz2", rows=600)
    epochs, k = 4, 2
    out, err, took = _run_example_logged(
        "pytorch_spark_mnist.py",
        "--master",
        "local[2]",
        "--num-proc",
        "2",
        "--batch-size",
        "16",
        "--epochs",
        str(epochs),
        "--backward-passes-per-step",
        str(k),
        "--work-dir",
        str(tmp_path / "store"),
        "--data-dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    accuracy = float(re.search(r"^Test accuracy: ([0-9.]+)$", out, re.MULTILINE).group(1))
    fit = re.search(r"on 2 ranks: (\d+) train rows, (\d+) val rows, (\d+) steps/epoch", err)
    assert fit, err[-3000:]
    val_rows, steps = int(fit.group(2)), int(fit.group(3))
    # Store.create(args.work_dir) held the run; its last checkpoint: every epoch validated, and one
    # optimizer step per k batches (the example's backward_passes_per_step)
    (run,) = (tmp_path / "store" / "runs").iterdir()
    last = json.loads((run / "checkpoints" / f"epoch-{epochs:04d}.json").read_text())
    history = last["history"]
    print(
        f"pytorch mnist port: test accuracy {accuracy:.3f} (chance 0.1) in {took:.1f} s; {steps} steps/epoch, "
        f"{last['iterations']} optimizer steps, val_loss {[round(h['val_loss'], 4) for h in history]}"
    )
    assert accuracy > 0.8, out[-3000:]
    assert val_rows > 0 and len(history) == epochs and history[-1]["val_loss"] < history[0]["val_loss"]
    assert last["iterations"] == epochs * steps // k


# --- Rossmann ------------------------------------------------------------------------------------

STATES = [("NordrheinWestfalen", "NW"), ("Bayern", "BY"), ("Niedersachsen", "HB,NI")]  # NI: the trend's own name
TRAIN_DAYS = (datetime.date(2014, 5, 19), datetime.date(2014, 7, 13))
TEST_DAYS = (datetime.date(2015, 6, 11), datetime.date(2015, 6, 20))  # validation: 2014-06-12 .. 2014-06-20
STORES = 6


def _days(first: datetime.date, last: datetime.date) -> list[datetime.date]:
    return [first + datetime.timedelta(d) for d in range((last - first).days + 1)]


def _write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows([["" if v is None else v for v in row] for row in rows])


def _write_rossmann(data_dir: Path, seed: int = 0) -> dict:
    """The seven CSV files of the Rossmann example (Kaggle's train, test and store, and fast.ai's
    store_states, state_names, googletrend and weather), with their columns, for ``STORES`` stores
    in three states: a weather row per state and day, a Google trend row per state (and Germany)
    and week. Sales grow with promotions and the store's size, and are 0 on a closed day.

    The continuous columns stay small (about -3 to 3; holidays and promotions every few days and
    on the last training day and the first test day, so that the example's days before / after them,
    counted across the year between the two, are small too): the model's BatchNormalization predicts with its
    moving statistics, which the few steps of a short run leave near their initial mean 0 and
    variance 1, so real-world magnitudes (distances in metres, trends up to 100) would saturate the
    output's sigmoid on every prediction, as they would in the example after a few steps."""
    rng = np.random.default_rng(seed)
    train_days, test_days = _days(*TRAIN_DAYS), _days(*TEST_DAYS)
    size = {s: 4000 + 1500 * s for s in range(1, STORES + 1)}
    state_of = {s: STATES[(s - 1) % len(STATES)][1] for s in size}
    train, test = [], []
    edges = (TRAIN_DAYS[1], TEST_DAYS[0])  # every kind of event on both
    for day in train_days:
        for s in size:
            open_ = 0 if day.weekday() == 6 else 1
            promo = int(day.day % 7 < 3 or day in edges)
            sales = int(size[s] * (1.3 if promo else 1.0) * (1 + 0.05 * day.weekday()) * rng.uniform(0.95, 1.05))
            holiday, school = ("a", 1) if day in edges else ("a" if day.day % 4 == 0 else "0", int(day.day % 3 == 0))
            train.append(
                [
                    s,
                    day.isoweekday(),
                    day.isoformat(),
                    sales * open_,
                    sales // 9 * open_,
                    open_,
                    promo,
                    holiday,
                    school,
                ]
            )
    for day in test_days:
        for s in size:
            promo = int(day.day % 7 < 3 or day in edges)
            holiday, school = ("a", 1) if day in edges else ("a" if day.day % 4 == 0 else "0", int(day.day % 3 == 0))
            test.append(
                [len(test) + 1, s, day.isoweekday(), day.isoformat(), int(day.weekday() != 6), promo, holiday, school]
            )
    _write_csv(
        data_dir / "train.csv",
        ["Store", "DayOfWeek", "Date", "Sales", "Customers", "Open", "Promo", "StateHoliday", "SchoolHoliday"],
        train,
    )
    _write_csv(
        data_dir / "test.csv",
        ["Id", "Store", "DayOfWeek", "Date", "Open", "Promo", "StateHoliday", "SchoolHoliday"],
        test,
    )
    stores = []
    for s in size:
        promo2 = s % 2
        stores.append(
            [
                s,
                "abcd"[s % 4],
                "abc"[s % 3],
                None if s == 3 else 0.25 * s,  # a store without a competitor nearby
                None if s % 3 == 0 else 1 + s,
                None if s % 3 == 0 else 2008 + s % 4,
                promo2,
                10 + s if promo2 else None,
                2011 if promo2 else None,
                "Jan,Apr,Jul,Oct" if promo2 else None,
            ]
        )
    _write_csv(
        data_dir / "store.csv",
        [
            "Store",
            "StoreType",
            "Assortment",
            "CompetitionDistance",
            "CompetitionOpenSinceMonth",
            "CompetitionOpenSinceYear",
            "Promo2",
            "Promo2SinceWeek",
            "Promo2SinceYear",
            "PromoInterval",
        ],
        stores,
    )
    _write_csv(data_dir / "store_states.csv", ["Store", "State"], [[s, state_of[s]] for s in size])
    _write_csv(data_dir / "state_names.csv", ["StateName", "State"], [list(x) for x in STATES])
    # One trend row per week, Sunday to Saturday as Google's, named by its Sunday: the one whose ISO
    # week (weekofyear) is each day's.
    sundays = sorted({d + datetime.timedelta(6 - d.weekday()) for d in train_days + test_days})
    files = ["Rossmann_DE"] + ["Rossmann_DE_" + ("NI" if code == "HB,NI" else code) for _, code in STATES]
    trend = [
        [f, f"{s.isoformat()} - {(s + datetime.timedelta(6)).isoformat()}", round(float(rng.uniform(0.4, 1.0)), 2)]
        for f in files
        for s in sundays
    ]
    _write_csv(data_dir / "googletrend.csv", ["file", "week", "trend"], trend)
    weather_cols = [
        "file",
        "Date",
        "Max_TemperatureC",
        "Mean_TemperatureC",
        "Min_TemperatureC",
        "Dew_PointC",
        "MeanDew_PointC",
        "Min_DewpointC",
        "Max_Humidity",
        "Mean_Humidity",
        "Min_Humidity",
        "Max_Sea_Level_PressurehPa",
        "Mean_Sea_Level_PressurehPa",
        "Min_Sea_Level_PressurehPa",
        "Max_VisibilityKm",
        "Mean_VisibilityKm",
        "Min_VisibilitykM",
        "Max_Wind_SpeedKm_h",
        "Mean_Wind_SpeedKm_h",
        "Max_Gust_SpeedKm_h",
        "Precipitationmm",
        "CloudCover",
        "Events",
        "WindDirDegrees",
    ]
    weather = []
    for name, _ in STATES:
        for d in train_days + test_days:
            t = int(rng.integers(-1, 2))
            weather.append(
                [name, d.isoformat(), t + 1, t, t - 1, 10, 8, 6, 0.9, 0.7, 0.5, 1020, 1015, 1010, 31, 15, 10]
                + [round(float(rng.uniform(0, 1.5)), 2), round(float(rng.uniform(0, 1)), 2), None, 0.0]
                + [int(rng.integers(0, 3)), ["Rain", None, "Fog-Rain"][d.day % 3], 200]
            )
    _write_csv(data_dir / "weather.csv", weather_cols, weather)
    val_first = TEST_DAYS[0] - datetime.timedelta(365)
    val_last = TEST_DAYS[1] - datetime.timedelta(365)
    val_rows = sum(1 for r in train if r[3] > 0 and val_first < datetime.date.fromisoformat(r[2]) <= val_last)
    return {
        "train_rows": sum(1 for r in train if r[3] > 0) - val_rows,
        "val_rows": val_rows,
        "test_rows": len(test),
        "max_sales": max(r[3] for r in train),
    }


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.slow  # about 2 minutes: bash scripts/test.sh -m slow tests/test_horovod_port.py
def test_keras_spark_rossmann_estimator_runs_with_only_its_imports_changed(spark, tmp_path):
    import keras

    import hvd_spark
    from hvd_spark.keras import BestModelCheckpoint

    data = tmp_path / "data"
    data.mkdir()
    sizes = _write_rossmann(data)
    saved = tmp_path / "rossmann_model"
    submission = tmp_path / "submission.csv"
    epochs = 6
    out, took = _run_example(
        "keras_spark_rossmann_estimator.py",
        "--master",
        "local[2]",
        "--num-proc",
        "2",
        "--learning_rate",
        "0.001",
        "--batch-size",
        "16",
        "--epochs",
        str(epochs),
        "--data-dir",
        "file://" + str(data),
        "--local-submission-csv",
        str(submission),
        "--local-checkpoint-file",
        str(saved),
        "--work-dir",
        str(tmp_path / "store"),
        cwd=tmp_path,
    )
    # The example's own report of its data: every row survived its joins (it asserts that itself).
    assert f"Training: {sizes['train_rows']}\nValidation: {sizes['val_rows']}\nTest: {sizes['test_rows']}" in out
    best_rmspe = float(re.search(r"^Best RMSPE: ([0-9.]+)$", out, re.MULTILINE).group(1))

    # SparkBackend(stdout=sys.stdout, prefix_output_with_timestamp=True): the ranks' lines (verbose=2:
    # Keras' epoch lines on rank 0) reached stdout in horovod's format.
    rank_lines = RANK_LINE.findall(out)
    assert any(rank == "0" and re.search(r"Epoch \d+/\d+|val_loss", line) for rank, line in rank_lines), out[-3000:]

    # What the example saved: the model fit returned (keras_model.save(args.local_checkpoint_file)).
    fitted = hvd_spark.KerasModel.load(str(saved))
    assert isinstance(fitted, hvd_spark.TFTransformer)
    val_loss = fitted.getHistory()["val_loss"]
    assert len(val_loss) == epochs and all(math.isfinite(v) for v in val_loss)
    assert min(val_loss[1:]) < val_loss[0]  # it learned
    assert best_rmspe == pytest.approx(min(fitted.getHistory()["val_exp_rmspe"]), abs=1e-6)
    assert best_rmspe < 1.0

    # BestModelCheckpoint(monitor='val_loss'): the model returned is the best epoch's, not the last one's.
    store = hvd_spark.Store.create(str(tmp_path / "store"))
    (run,) = store.runs()
    checkpoints = {c.epoch: c for c in store.checkpoints(run["run_id"])}
    assert sorted(checkpoints) == list(range(1, epochs + 1))
    best = int(np.argmin(val_loss)) + 1
    custom = fitted.getOrDefault(fitted.custom_objects)

    def epoch_weights(epoch):
        return _weights(keras.saving.load_model(checkpoints[epoch].model_path, custom_objects=custom, compile=False))

    returned = _weights(fitted.getModel())
    assert all(np.array_equal(a, b) for a, b in zip(returned, epoch_weights(best), strict=True))
    if best != epochs:
        assert not all(np.array_equal(a, b) for a, b in zip(returned, epoch_weights(epochs), strict=True))
    print(
        f"rossmann port: {took:.1f} s, val_loss per epoch {[round(v, 4) for v in val_loss]}, best epoch {best} "
        f"of {epochs}, best RMSPE {best_rmspe:.4f}"
    )

    # The final prediction: one row per test row, finite sales.
    import pandas as pd

    sub = pd.read_csv(submission)
    assert list(sub.columns) == ["Id", "Sales_pred"] and len(sub) == sizes["test_rows"]
    # finite, and none at the output's ceiling (max sales ** 1.2: a saturated sigmoid)
    assert np.isfinite(sub.Sales_pred).all() and (sub.Sales_pred > 0).all()
    assert (sub.Sales_pred < 2 * sizes["max_sales"]).all(), sub.Sales_pred.describe()

    cb = BestModelCheckpoint(monitor="val_loss", mode="auto", save_freq="epoch")
    assert isinstance(cb, keras.callbacks.ModelCheckpoint) and cb.save_best_only and not cb.save_weights_only
    assert BestModelCheckpoint(save_weights_only=True).filepath.endswith(".weights.h5")


# --- SparkBackend and KerasEstimator on the shared session ----------------------------------------


def test_a_spark_backend_trains_as_the_default_backend_does(spark, tmp_path):
    """horovod's SparkBackend(num_proc, stdout, prefix_output_with_timestamp) as backend=: the same
    training as the default backend (same seed, same numbers), on warm ranks, with the ranks'
    output in the given stream in horovod's format."""
    import io

    from _helpers import small_model, xor_estimator, xor_frame

    import hvd_spark

    df = xor_frame(spark, 256)
    model = small_model()  # the same initial weights for both
    default = xor_estimator(tmp_path / "default", model=model, random_seed=3, verbose=2).fit(df)
    buf = io.StringIO()
    backend = hvd_spark.SparkBackend(num_proc=2, stdout=buf, prefix_output_with_timestamp=True)
    est = xor_estimator(tmp_path / "ported", model=model, random_seed=3, verbose=2, backend=backend)
    assert isinstance(est, hvd_spark.KerasEstimator) and est.getBackend() is backend
    ported = est.fit(df)

    assert ported.getHistory() == default.getHistory() and len(ported.getHistory()["loss"]) == 2
    assert all(np.array_equal(a, b) for a, b in zip(_weights(ported.getModel()), _weights(default.getModel())))
    summary = ported.getFitSummary()
    assert [r.rank for r in summary.ranks] == [0, 1] and all(r.startup["warm"] == 1.0 for r in summary.ranks)
    lines = RANK_LINE.findall(buf.getvalue())
    assert any(rank == "0" and line.startswith("Epoch 2/2") for rank, line in lines), buf.getvalue()[-2000:]


def test_keras_estimator_saves_and_loads(spark, tmp_path):
    import hvd_spark

    assert hvd_spark.KerasEstimator is hvd_spark.HorovodEstimator
    assert hvd_spark.KerasModel is hvd_spark.TFTransformer
    from _helpers import xor_estimator

    est = xor_estimator(tmp_path / "store", backend=hvd_spark.SparkBackend(num_proc=2), epochs=3)
    est.save(str(tmp_path / "est"))
    loaded = hvd_spark.KerasEstimator.load(str(tmp_path / "est"))
    assert isinstance(loaded, hvd_spark.KerasEstimator)
    assert loaded.getEpochs() == 3 and loaded.getBatchSize() == 16
    assert loaded.getBackend() == "gloo"  # a backend object is not saved: the default backend
