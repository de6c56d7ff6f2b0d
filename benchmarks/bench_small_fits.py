"""Issue 49, step one: what a small fit costs, phase by phase, against plain Keras in the same script.

The job: the README's main job (``examples/digits.py``): scikit-learn's digits, its train split of
1,437 rows (``digits_frames``), ``digits_model()`` (a small CNN), Adam 0.002, sparse categorical
cross-entropy, accuracy, 10% validation, 12 epochs, 2 ranks x batch 32 on ``local[2]``. The baseline:
plain Keras in a fresh process (``python`` start, imports, the same split and model, batch 64 so that
it makes the same steps, ``validation_split=0.1``, TensorFlow's default threads), timed from outside
(the whole process) and inside (imports, data, model, first step, training, predict of the 360
held-out rows).

hvd_spark runs in a fresh driver process of its own (a new Spark application, so its warm server
starts cold too) and records:

1. the cold fit: the first ``HorovodEstimator.fit`` of the process (the fit's wall time, and the
   process from its launch to the fit's return), against the plain process;
2. the warm fit: a second fit of the same configuration (a new run_id) in the same process;
3. each fit's phases: timestamps around the driver's steps (``ml/steps.py``'s functions wrapped in
   this process, no library code changed), the fit summary (``materialize_seconds``,
   ``train_job_seconds``, each rank's ``startup`` phases, ``first_step`` among them, and
   ``train_seconds``) and a callback on the ranks with an ``on_train_end`` only (a user callback with
   code at steps or epochs makes the ranks agree on ``model.stop_training`` there, an allreduce each);
4. the copy of the DataFrame to the store (the ``materialize`` step) of each fit;
5. ``transform`` of the 360 held-out rows (``.transform(df).collect()``), twice, and what the driver's
   transform does to them but the prediction (``toArrow``, ``createDataFrame``, ``collect``);
6. a ``CrossValidator``, 3 folds x 4 parameter maps (epochs x learning_rate), and its
   refit on all the rows, against the same 13 fits by plain Keras in one fresh process (about 2
   minutes of the run; ``--no-tuning`` leaves it out), with the 13 fits' checks, copies and training
   jobs (the ranks' start, training and exit) added up;
7. horovod.spark's ``KerasEstimator`` (its venv, ``benchmarks/baselines/setup.sh``): run by
   ``bench_overhead.py`` only; recorded here as not run, with the reason;
8. the floor of two ranks on this machine, with nothing of the estimator's (``hvd_spark.run``, 2
   ranks): plain Keras ``fit`` on in-memory arrays with ``hvd_spark.keras.make_distributed`` (the same
   steps: each rank's half of the rows at batch 32, its half of the validation rows each epoch), then
   the same steps in a bare ``tf.function`` loop with one grouped allreduce a step, and without it.

Targets (issue 49): the cold fit's wall time <= 1.3x the plain process's (the issue's measure; the
hvd_spark process from its launch to the cold fit's return is given beside it), warm fit <= 2.0 s,
copy <= 1 s, tuning <= 1.5x.

    python -m benchmarks.bench_small_fits [--quick] [--repeats 1] [--no-tuning]

``--quick``: 3 epochs (tuning: epochs 1 and 2), a smoke test, not the issue's figures.
"""

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

T_SCRIPT_START = time.time()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLES = os.path.join(ROOT, "examples")
CACHE = os.environ.get("HVD_SPARK_CACHE") or os.path.expanduser("~/.cache/hvd_spark")
LEGACY_PY = os.path.join(CACHE, "bench", "horovod-spark", "bin", "python")
EPOCHS, BATCH, LR, VALIDATION, SEED = 12, 32, 0.002, 0.1, 1
FOLDS, GRID_EPOCHS, GRID_LR = 3, (3, 6), (1e-3, 3e-3)
JOB_TIMEOUT_S = 1200.0
TUNING_PARTS = ("check", "materialize", "train_with_restarts")  # the fits' steps added up over the tuning
TARGETS = {"cold_over_plain": 1.3, "warm_fit_s": 2.0, "copy_s": 1.0, "tuning_over_plain": 1.5}


# --- inside a job's process --------------------------------------------------------------------


def _digits_arrays():
    """The train and held-out splits of examples/digits.py, as arrays (plain Keras' data)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    return train_test_split(X, y, test_size=0.2, random_state=7, stratify=y)


MODEL = "cnn"  # the job's model (--model): digits_model(), or an MLP (the first measurement)


def _model():
    """``digits_model()`` (a small CNN), or with ``--model mlp`` an MLP on the same input: 64-64-10."""
    import keras

    sys.path.insert(0, EXAMPLES)
    from digits import digits_model

    if MODEL == "cnn":
        return digits_model()
    inputs = keras.Input(shape=(8, 8, 1), name="pixels")
    x = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="digit")(x))


def _keras_fit(X, y, epochs: int, lr: float, validation: float, callbacks=()):
    import keras

    keras.utils.set_random_seed(SEED)
    m = _model()
    m.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    m.fit(X, y, batch_size=2 * BATCH, epochs=epochs, validation_split=validation, verbose=0, callbacks=list(callbacks))
    return m


def _marks_callback(folder: str, who: str | None = None):
    """A Keras callback writing ``folder/<who>.json``: the wall time of train end, and for plain Keras
    (``who`` given) of train begin and the first step's end. Built here so that it pickles by value (the
    ranks cannot import this folder). On the ranks it has no other hook: a user callback with code at
    steps makes the ranks agree on ``model.stop_training`` after every step, one with code at epochs
    (``on_train_begin`` too) at every epoch (an allreduce each), which this benchmark would then
    measure. A rank's train begin is its train end less its ``train_seconds`` (the time around its
    ``model.fit``), its first step the rank's ``startup["first_step"]``."""
    import keras

    class Marks(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rec: dict = {}

        def on_train_end(self, logs=None):
            self.rec["train_end"] = time.time()
            name = who or f"rank-{os.environ.get('HVD_SPARK_RANK', '0')}"
            with open(os.path.join(folder, f"{name}.json"), "w") as f:
                json.dump(self.rec, f)

    class PlainMarks(Marks):
        def on_train_begin(self, logs=None):
            self.rec["train_begin"] = time.time()

        def on_train_batch_end(self, batch, logs=None):
            self.rec.setdefault("first_step_end", time.time())

    return PlainMarks() if who else Marks()


def job_plain(a) -> dict:
    """Plain Keras: the main job's fit and the held-out rows' predict, timestamps inside."""
    t: dict = {"t_enter": T_SCRIPT_START}
    import keras  # noqa: F401 - TensorFlow's import, timed

    t["t_imported"] = time.time()
    X_tr, X_te, y_tr, y_te = _digits_arrays()
    t["t_data"] = time.time()
    marks = tempfile.mkdtemp(prefix="small_fits-plain-")
    m = _keras_fit(X_tr, y_tr, a.epochs, LR, VALIDATION, [_marks_callback(marks, "plain")])
    t["t_fit_end"] = time.time()
    with open(os.path.join(marks, "plain.json")) as f:
        t.update(json.load(f))
    shutil.rmtree(marks, ignore_errors=True)
    t["t_predict_begin"] = time.time()
    probs = m.predict(X_te, batch_size=256, verbose=0)
    t["t_predict_end"] = time.time()
    t["accuracy"] = float((probs.argmax(axis=1) == y_te).mean())
    return t


def job_plain_tuning(a) -> dict:
    """The CrossValidator's 13 fits by plain Keras: 3 folds x 4 maps, scored, then the best on all rows."""
    import numpy as np
    from sklearn.model_selection import KFold

    t0 = time.time()
    X, _, y, _ = _digits_arrays()
    grid = [(e, lr) for e in a.grid_epochs for lr in GRID_LR]
    scores = []
    for epochs, lr in grid:
        accs = []
        for tr, te in KFold(FOLDS, shuffle=True, random_state=SEED).split(X):
            m = _keras_fit(X[tr], y[tr], epochs, lr, 0.0)
            accs.append(float((m.predict(X[te], batch_size=256, verbose=0).argmax(axis=1) == y[te]).mean()))
        scores.append(float(np.mean(accs)))
    best = grid[int(np.argmax(scores))]
    _keras_fit(X, y, best[0], best[1], 0.0)
    return {"t_enter": T_SCRIPT_START, "t_begin": t0, "t_end": time.time(), "fits": len(grid) * FOLDS + 1,
            "avg_metrics": scores, "best": list(best)}  # fmt: skip


class _StepClock:
    """Wraps functions of the fit's modules in this process (no library code changed): (name, begin,
    end) of every call. The driver's steps (``ml/steps.py``), the checks' launch options (with the
    executors' check started) and in-place check (``ml/checks.py``), the copy's identity, key and
    parts (``data/fit_data.py``, ``data/materialize.py``)."""

    WRAPPED = {
        "hvd_spark._internal.ml.steps": ("check", "plan_resume", "_identify", "materialize", "plan_ranks",
                                         "train_with_restarts", "verify_and_build"),
        "hvd_spark._internal.ml.checks": ("_launch_options", "read_in_place"),
        "hvd_spark._internal.data.fit_data": ("data_identity", "dataset_key"),
        "hvd_spark._internal.data.materialize": ("prepare", "_write_attempt", "_parquet_files", "_observed",
                                                 "_publish"),
    }  # fmt: skip

    def __init__(self):
        import importlib

        self.calls: list[tuple[str, float, float]] = []
        self.waits: list[tuple[float, float]] = []  # (when, seconds the fit waited for the executors' check)
        log = logging.getLogger("hvd_spark._internal.ml.checks")
        log.addHandler(self)  # type: ignore[arg-type] - handle() below is all logging asks of a handler
        log.setLevel(logging.DEBUG)
        self.level = logging.DEBUG
        for module, names in self.WRAPPED.items():
            mod = importlib.import_module(module)
            for name in names:
                setattr(mod, name, self._wrap(name, getattr(mod, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append((name, t, time.time()))

        return timed

    def handle(self, record) -> bool:
        m = re.search(r"the fit waited ([0-9.]+) s", record.getMessage())
        if m:
            self.waits.append((record.created, float(m.group(1))))
        return True

    def since(self, t0: float, t1: float) -> dict[str, tuple[float, float]]:
        """The last call of each name that began in [t0, t1]."""
        return {name: (b, e) for name, b, e in self.calls if t0 <= b <= t1}

    def total(self, name: str, t0: float, t1: float) -> float:
        """Seconds in every call of ``name`` that began in [t0, t1]."""
        return sum(e - b for n, b, e in self.calls if n == name and t0 <= b <= t1)


def copy_parts(clock: _StepClock, b: float, e: float) -> dict:
    """The copy (the ``materialize`` step, [b, e]) split: identity, key, the Spark job, footers, stats, publish."""
    parts = {k: clock.total(k, b, e) for k in ("prepare", "data_identity", "dataset_key", "_parquet_files",
                                               "_observed", "_publish")}  # fmt: skip
    attempt = clock.total("_write_attempt", b, e)
    parts["spark_write_job"] = (
        attempt - parts["_parquet_files"] - parts["_observed"] - parts["_publish"] if attempt else 0.0
    )
    parts["wrote_a_copy"] = attempt > 0  # False: the data of an earlier fit reused
    return parts


def _estimator(store: str, marks: str, epochs: int, validation: float = VALIDATION):
    import keras

    from hvd_spark import HorovodEstimator

    return HorovodEstimator(
        num_proc=2,
        store=store,
        model=_model(),
        optimizer=keras.optimizers.Adam(learning_rate=LR),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        validation=validation,
        batch_size=BATCH,
        epochs=epochs,
        random_seed=SEED,
        callbacks=[_marks_callback(marks)] if marks else [],
        verbose=0,
    )


def fit_phases(clock: _StepClock, t0: float, t_ret: float, summary, marks: str) -> dict:
    """A fit's phases in seconds, from the driver's step times, the summary and the ranks' marks."""
    s = clock.since(t0, t_ret)
    ranks = {}
    for r in summary.ranks:
        with open(os.path.join(marks, f"rank-{r.rank}.json")) as f:
            marks_of = json.load(f)
        marks_of["train_begin"] = marks_of["train_end"] - r.train_seconds
        ranks[r.rank] = dict(marks_of, startup=r.startup or {}, train_seconds=r.train_seconds)
    r0, st = ranks[0], ranks[0]["startup"]
    train_b, train_e = s["train_with_restarts"]
    before_fit = sum(st.get(k, 0.0) for k in ("horovod_init", "model", "data"))
    t_task_asked = r0["train_begin"] - before_fit - st.get("process", 0.0)
    lo_b, lo_e = s["_launch_options"]
    ph = {
        "checks_before_launch_options": lo_b - t0,
        "checks_launch_options": lo_e - lo_b,
        "checks_model_columns_executors_store": s["read_in_place"][0] - lo_e,
        "checks_read_in_place": s["check"][1] - s["read_in_place"][0],
        "run_plan_and_data_identity": s["materialize"][0] - s["check"][1],
        "data_copy": s["materialize"][1] - s["materialize"][0],
        "rank_plan": s["plan_ranks"][1] - s["plan_ranks"][0],
        "launch_to_rank_task": t_task_asked - train_b,
        "rank_process": st.get("process"),
        "rendezvous_horovod_init": st.get("horovod_init"),
        "rank_model": st.get("model"),
        "rank_readers": st.get("data"),
        "first_step": st.get("first_step"),  # from the readers' opening to the first step's end
        "training_after_first_step": r0["train_end"] - r0["train_begin"] - st.get("first_step", 0.0),
        "final_model_and_job_end": train_e - r0["train_end"],
        "verify_and_build": s["verify_and_build"][1] - s["verify_and_build"][0],
        "return": t_ret - s["verify_and_build"][1],
    }
    ph["between_steps_unaccounted"] = (t_ret - t0) - sum(ph.values())
    return {
        "phases_s": ph,
        "driver_checks_s": s["check"][1] - t0,
        "checks_waited_for_executors_s": sum(w for t, w in clock.waits if t0 <= t <= t_ret),
        "copy_parts_s": copy_parts(clock, *s["materialize"]),
        "warm_rank": bool(st.get("warm")),
        "summary": {"materialize_seconds": summary.materialize_seconds, "train_job_seconds": summary.train_job_seconds,
                    "fit_seconds": summary.fit_seconds, "steps_per_epoch": summary.steps_per_epoch,
                    "rank_train_seconds": {str(k): v["train_seconds"] for k, v in ranks.items()},
                    "rank_startup": {str(k): v["startup"] for k, v in ranks.items()}},
    }  # fmt: skip


def _one_fit(clock, est, df, marks) -> dict:
    t0 = time.time()
    fitted = est.fit(df)
    t_ret = time.time()
    out = {"fit_s": t_ret - t0, "t_fit_begin": t0, "t_fit_end": t_ret}
    out.update(fit_phases(clock, t0, t_ret, fitted.getFitSummary(), marks))
    out["val_accuracy"] = (fitted.getHistory().get("val_accuracy") or [None])[-1]
    return out, fitted


def job_hvd(a) -> dict:
    """hvd_spark in a fresh driver: session, cold fit, warm fit, transform twice (and the tuning loop)."""
    out: dict = {"t_enter": T_SCRIPT_START}
    sys.path.insert(0, EXAMPLES)
    import cloudpickle

    import hvd_spark

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    clock = _StepClock()
    out["t_imported"] = time.time()
    # as the README's job (examples/digits.py): the session starts the warm server of 2-rank fits
    spark = hvd_spark.local_session("local[2]", app_name="hvd_spark-bench-small-fits", prewarm=2)
    spark.sparkContext.setLogLevel("ERROR")
    out["t_session"] = time.time()
    from digits import digits_frames

    train, test = digits_frames(spark)
    out["t_frames"] = time.time()
    store, marks = tempfile.mkdtemp(prefix="small_fits-store-"), tempfile.mkdtemp(prefix="small_fits-marks-")
    try:
        out["cold"], _ = _one_fit(clock, _estimator(store, marks, a.epochs), train, marks)
        out["warm"], fitted = _one_fit(clock, _estimator(store, marks, a.epochs), train, marks)
        for k in ("transform_first_s", "transform_second_s"):
            t0 = time.time()
            rows = fitted.transform(test).collect()
            out[k] = time.time() - t0
        out["transform_rows"] = len(rows)
        out["accuracy"] = sum(int(r["prediction"]) == r["label"] for r in rows) / len(rows)
        out["spark_round_trip_s"] = spark_round_trip(spark, test)
        out["floor"] = floor(a.epochs)
        if a.tuning:
            out["tuning"] = tuning(train, store, a.grid_epochs, clock)
    finally:
        spark.stop()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(marks, ignore_errors=True)
    return out


def spark_round_trip(spark, df) -> float:
    """Seconds of what a driver ``transform`` does but the prediction, on the held-out rows: ``toArrow``,
    ``createDataFrame`` of the Arrow table, and the caller's ``collect`` (the floor of a second transform)."""
    t0 = time.time()
    spark.createDataFrame(df.toArrow()).collect()
    return time.time() - t0


def _floor_rank(epochs: int) -> dict:
    """One rank of the floor job (``hvd_spark.run``, 2 ranks): the fit's training with nothing of the
    estimator around it. Plain Keras ``fit`` on in-memory arrays: the rank's half of the training rows
    (every other row of what ``validation_split`` leaves), batch 32, 12 epochs, the rank's half of the
    validation rows evaluated each epoch (Keras' own evaluation: not summed over the ranks), the
    gradients averaged by ``hvd_spark.keras.make_distributed`` (one fused allreduce a step), rank 0's
    starting state broadcast. Returns its first step and the training after it, in seconds."""
    import math

    import horovod.tensorflow as hvd
    import keras

    import hvd_spark.keras as hk

    hvd.init()
    X, _, y, _ = _digits_arrays()
    cut = int(math.ceil(len(X) * (1 - VALIDATION)))  # Keras' validation_split: the last rows
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(SEED)
    m = _model()
    m.compile(optimizer=hk.make_distributed(keras.optimizers.Adam(LR)), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])  # fmt: skip
    folder = tempfile.mkdtemp(prefix="small_fits-floor-")
    marks = _marks_callback(folder, f"floor-{r}")
    m.fit(X[:cut][r::n], y[:cut][r::n], batch_size=BATCH, epochs=epochs, validation_data=(X[cut:][r::n], y[cut:][r::n]),
          verbose=0, shuffle=False, callbacks=[hk.BroadcastStateCallback(), marks])  # fmt: skip
    rec = marks.rec
    shutil.rmtree(folder, ignore_errors=True)
    steps = epochs * math.ceil((cut // n) / BATCH)  # the same on every rank: each makes as many allreduces
    return {"rank": r, "first_step_s": rec["first_step_end"] - rec["train_begin"],
            "training_after_first_step_s": rec["train_end"] - rec["first_step_end"], "steps": steps,
            "bare_loop_s": _bare_loop(m, X[:cut][r::n], y[:cut][r::n], steps, True),
            "bare_loop_no_allreduce_s": _bare_loop(m, X[:cut][r::n], y[:cut][r::n], steps, False)}  # fmt: skip


def _bare_loop(m, X, y, steps: int, allreduce: bool) -> float:
    """Seconds of ``steps`` training steps after the first (traced) one, in a loop with nothing else: a
    ``tf.function`` of the forward and backward pass, one grouped allreduce of the gradients (or none:
    each rank's compute alone, both ranks busy), the optimizer's update; the batches made beforehand."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    opt, loss_fn = keras.optimizers.Adam(LR), keras.losses.SparseCategoricalCrossentropy()
    batches = [(tf.constant(X[i : i + BATCH]), tf.constant(y[i : i + BATCH])) for i in range(0, len(X), BATCH)]

    @tf.function
    def step(x, t):
        with tf.GradientTape() as tape:
            loss = loss_fn(t, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        if allreduce:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        opt.apply(grads, m.trainable_variables)
        return loss

    step(*batches[0]).numpy()
    step(*batches[-1]).numpy()  # a last part's shape traced too: no trace in the timed loop
    hvd.allreduce(tf.constant(0.0), name=f"floor.sync.{allreduce}")  # both ranks start together
    t0 = time.time()
    for i in range(1, steps):
        loss = step(*batches[i % len(batches)])
    loss.numpy()
    return time.time() - t0


def floor(epochs: int) -> dict:
    """The floor job on 2 ranks (the session's warm server, as the fits): rank 0's figures."""
    import hvd_spark

    t0 = time.time()
    ranks = hvd_spark.run(_floor_rank, args=(epochs,), num_proc=2, verbose=0)
    r0 = next(r for r in ranks if r["rank"] == 0)
    return dict(r0, run_s=time.time() - t0)


def tuning(train, store: str, grid_epochs, clock: "_StepClock | None" = None) -> dict:
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    est = _estimator(store, "", max(grid_epochs), validation=0.0)
    grid = ParamGridBuilder().addGrid(est.epochs, list(grid_epochs)).addGrid(est.learning_rate, list(GRID_LR)).build()
    ev = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction", metricName="accuracy")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=ev, numFolds=FOLDS, seed=SEED)
    t0 = time.time()
    model = cv.fit(train)
    t1 = time.time()
    out = {"wall_s": t1 - t0, "fits": len(grid) * FOLDS + 1, "avg_metrics": list(model.avgMetrics)}
    if clock is not None:  # where the 13 fits' time went: the ranks' training jobs, the copies, the rest
        out["parts_s"] = {k: clock.total(k, t0, t1) for k in TUNING_PARTS}
    return out


# --- the parent: every job in a fresh process ------------------------------------------------------


def run_job(kind: str, epochs: int, grid_epochs, tuning_on: bool = False) -> dict:
    """One job in a fresh process (its own session); its JSON result, with its launch and whole time."""
    cmd = [sys.executable, "-m", "benchmarks.bench_small_fits", "--job", kind, "--epochs", str(epochs)]
    cmd += ["--model", MODEL]
    cmd += ["--grid-epochs", *map(str, grid_epochs)] + (["--tuning"] if tuning_on else [])
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        env.pop(k, None)
    from benchmarks.common import run_in_group

    t0 = time.time()
    out, err, returncode, whole = run_in_group(cmd, env, JOB_TIMEOUT_S)
    found = [line for line in out.splitlines() if line.startswith("{")]
    if not found:
        tail = "\n".join((err or "").strip().splitlines()[-12:])
        return {"outcome": "failed", "error": f"exit {returncode}; stderr tail:\n{tail}", "whole_s": whole}
    return dict(json.loads(found[-1]), outcome="ok", t_launch=t0, whole_s=whole)


def plain_figures(r: dict) -> dict:
    """The plain process's phases (seconds) from its launch (the parent's clock) and its marks."""
    if r.get("outcome") != "ok":
        return r
    return {
        "process_s": r["whole_s"],
        "process_to_fit_end_s": r["t_fit_end"] - r["t_launch"],
        "fit_s": r["t_fit_end"] - r["t_data"],
        "phases_s": {
            "python_start_and_imports": r["t_imported"] - r["t_launch"],
            "data": r["t_data"] - r["t_imported"],
            "model_and_compile": r["train_begin"] - r["t_data"],
            "first_step": r["first_step_end"] - r["train_begin"],
            "training_after_first_step": r["train_end"] - r["first_step_end"],
            "return": r["t_fit_end"] - r["train_end"],
        },
        "predict_360_s": r["t_predict_end"] - r["t_predict_begin"],
        "accuracy": r["accuracy"],
    }


def hvd_figures(r: dict) -> dict:
    if r.get("outcome") != "ok":
        return r
    return {
        "process_s": r["whole_s"],
        "process_to_cold_fit_end_s": r["cold"]["t_fit_end"] - r["t_launch"],
        "python_start_and_imports_s": r["t_imported"] - r["t_launch"],
        "session_s": r["t_session"] - r["t_imported"],
        "frames_s": r["t_frames"] - r["t_session"],
        "model_and_estimator_s": r["cold"]["t_fit_begin"] - r["t_frames"],  # the driver's TensorFlow import
        "cold_fit": {k: v for k, v in r["cold"].items() if not k.startswith("t_")},
        "warm_fit": {k: v for k, v in r["warm"].items() if not k.startswith("t_")},
        "transform_first_s": r["transform_first_s"],
        "transform_second_s": r["transform_second_s"],
        "transform_rows": r["transform_rows"],
        "accuracy": r["accuracy"],
        "spark_round_trip_s": r.get("spark_round_trip_s"),
        "floor": r.get("floor"),
    }


def _med(runs: list[dict], *path):
    vals = []
    for r in runs:
        for k in path:
            r = r.get(k) if isinstance(r, dict) else None
        if isinstance(r, int | float):
            vals.append(float(r))
    return statistics.median(vals) if vals else None


def _target(name: str, value, limit: float, note: str = "") -> dict:
    return {"target": name, "value": value, "limit": limit, "met": None if value is None else value <= limit,
            "note": note}  # fmt: skip


def summarize(plain: list[dict], hvd: list[dict], tune_plain: list[dict], tune_hvd: list[dict]) -> dict:
    """Medians over the repeats, the ratios to plain Keras and the issue's targets."""
    m = {
        "plain_process_s": _med(plain, "process_s"),
        "plain_fit_s": _med(plain, "fit_s"),
        "plain_predict_360_s": _med(plain, "predict_360_s"),
        "hvd_process_to_cold_fit_end_s": _med(hvd, "process_to_cold_fit_end_s"),
        "cold_fit_s": _med(hvd, "cold_fit", "fit_s"),
        "warm_fit_s": _med(hvd, "warm_fit", "fit_s"),
        "cold_copy_s": _med(hvd, "cold_fit", "phases_s", "data_copy"),
        "warm_copy_s": _med(hvd, "warm_fit", "phases_s", "data_copy"),
        "transform_first_s": _med(hvd, "transform_first_s"),
        "transform_second_s": _med(hvd, "transform_second_s"),
        "spark_round_trip_s": _med(hvd, "spark_round_trip_s"),
        "tuning_hvd_s": _med(tune_hvd, "wall_s"),
        "tuning_plain_process_s": _med(tune_plain, "whole_s"),
        "tuning_hvd_parts_s": {
            k: _med(tune_hvd, "parts_s", k) for k in ("check", "materialize", "train_with_restarts")
        },
        "floor_first_step_s": _med(hvd, "floor", "first_step_s"),
        "floor_training_after_first_step_s": _med(hvd, "floor", "training_after_first_step_s"),
        "floor_run_s": _med(hvd, "floor", "run_s"),
        "floor_bare_loop_s": _med(hvd, "floor", "bare_loop_s"),
        "floor_bare_loop_no_allreduce_s": _med(hvd, "floor", "bare_loop_no_allreduce_s"),
    }
    for fit in ("cold_fit", "warm_fit"):
        keys = (hvd[0].get(fit) or {}).get("phases_s", {}) if hvd else {}
        m[f"{fit}_phases_s"] = {k: _med(hvd, fit, "phases_s", k) for k in keys}
    keys = plain[0].get("phases_s", {}) if plain else {}
    m["plain_phases_s"] = {k: _med(plain, "phases_s", k) for k in keys}
    before = ("python_start_and_imports", "session", "frames", "model_and_estimator")
    m["hvd_process_before_fit_s"] = {k: _med(hvd, f"{k}_s") for k in before}
    for fit in ("cold_fit", "warm_fit"):
        keys = (hvd[0].get(fit) or {}).get("copy_parts_s", {}) if hvd else {}
        m[f"{fit}_copy_parts_s"] = {k: _med(hvd, fit, "copy_parts_s", k) for k in keys if k != "wrote_a_copy"}
        m[f"{fit}_waited_for_executors_s"] = _med(hvd, fit, "checks_waited_for_executors_s")

    def ratio(a, b):
        return None if a is None or not b else a / b

    m["cold_process_over_plain_process"] = ratio(m["hvd_process_to_cold_fit_end_s"], m["plain_process_s"])
    m["cold_fit_over_plain_process"] = ratio(m["cold_fit_s"], m["plain_process_s"])
    m["tuning_over_plain"] = ratio(m["tuning_hvd_s"], m["tuning_plain_process_s"])
    targets = [
        _target("cold fit (first in the process) / the plain Keras process", m["cold_fit_over_plain_process"],
                TARGETS["cold_over_plain"], "the hvd_spark process, launch to the cold fit's return, / the plain "
                f"process: {m['cold_process_over_plain_process']}"),
        _target("warm fit s (second fit, same application)", m["warm_fit_s"], TARGETS["warm_fit_s"]),
        _target("copy of the DataFrame to the store s (cold fit's materialize step)", m["cold_copy_s"],
                TARGETS["copy_s"], f"the warm fit's (data reused): {m['warm_copy_s']}"),
        _target("CrossValidator 3 folds x 4 maps / the same fits by plain Keras in one process",
                m["tuning_over_plain"], TARGETS["tuning_over_plain"],
                "" if tune_hvd else "not run (--no-tuning)"),
    ]  # fmt: skip
    return {"medians": m, "targets": targets}


def _row(name: str, value, plain=None) -> str:
    def f(v):
        return "-" if v is None else f"{v:.2f}"

    return f"| {name} | {f(value)} | {f(plain)} |"


def table(s: dict) -> str:
    m = s["medians"]
    lines = ["| figure (s, medians) | hvd_spark | plain Keras |", "| --- | --- | --- |"]
    lines.append(_row("process: launch to the first fit's return", m["hvd_process_to_cold_fit_end_s"],
                      m["plain_process_s"]))  # fmt: skip
    lines.append(_row("cold fit (first in the process)", m["cold_fit_s"], m["plain_fit_s"]))
    lines.append(_row("warm fit (second, same application)", m["warm_fit_s"], m["plain_fit_s"]))
    lines.append(_row("transform of 360 rows, first / plain predict", m["transform_first_s"], m["plain_predict_360_s"]))
    lines.append(_row("transform of 360 rows, second", m["transform_second_s"]))
    lines.append(_row("the same rows' toArrow, createDataFrame and collect (no prediction)", m["spark_round_trip_s"]))
    lines.append(_row("tuning: CrossValidator 3x4 (+ refit)", m["tuning_hvd_s"], m["tuning_plain_process_s"]))
    for k, v in m["tuning_hvd_parts_s"].items():
        lines.append(_row(f"tuning: the 13 fits' {k}", v))
    for k, v in m["hvd_process_before_fit_s"].items():
        lines.append(_row(f"driver process before the cold fit: {k}", v))
    for fit in ("cold_fit", "warm_fit"):
        for k, v in m[f"{fit}_phases_s"].items():
            lines.append(_row(f"{fit} phase: {k}", v))
        for k, v in m[f"{fit}_copy_parts_s"].items():
            lines.append(_row(f"{fit} data_copy part: {k}", v))
        lines.append(_row(f"{fit} checks: waited for the executors' check", m[f"{fit}_waited_for_executors_s"]))
    for k, v in m["plain_phases_s"].items():
        lines.append(_row(f"plain phase: {k}", None, v))
    lines.append(_row("floor (2 ranks, Keras fit + Horovod alone): first step", m["floor_first_step_s"]))
    lines.append(_row("floor: training after the first step", m["floor_training_after_first_step_s"]))
    lines.append(_row("floor: the whole hvd_spark.run", m["floor_run_s"]))
    lines.append(_row("floor: the same steps, a bare loop with one allreduce a step", m["floor_bare_loop_s"]))
    lines.append(_row("floor: the bare loop without the allreduce", m["floor_bare_loop_no_allreduce_s"]))
    for t in s["targets"]:
        lines.append(f"target {t['target']}: {t['value']} (<= {t['limit']}): {t['met']} {t['note']}")
    return "\n".join(lines)


def main(quick: bool, repeats: int, tuning_on: bool) -> dict:
    epochs = 3 if quick else EPOCHS
    grid_epochs = (1, 2) if quick else GRID_EPOCHS
    t_all = time.time()
    plain, hvd, tune_plain, tune_hvd = [], [], [], []
    for rep in range(repeats):  # alternated: plain, then hvd_spark, then the tuning pair
        p = run_job("plain", epochs, grid_epochs)
        plain.append(plain_figures(p))
        print(f"repeat {rep + 1} plain: {json.dumps(plain[-1])}", flush=True)
        h = run_job("hvd", epochs, grid_epochs, tuning_on)
        hvd.append(hvd_figures(h))
        print(f"repeat {rep + 1} hvd_spark: {json.dumps(hvd[-1])}", flush=True)
        if tuning_on:
            tp = run_job("plain_tuning", epochs, grid_epochs)
            tune_plain.append({k: v for k, v in tp.items() if not k.startswith("t_")} | {
                "inside_s": (tp.get("t_end") or 0) - (tp.get("t_begin") or 0)})  # fmt: skip
            tune_hvd.append(h.get("tuning") or {"outcome": "failed"})
            print(f"repeat {rep + 1} tuning: plain {tune_plain[-1]} hvd_spark {tune_hvd[-1]}", flush=True)
    out = {
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "quick": quick,
        "repeats": repeats,
        "epochs": epochs,
        "model": MODEL,
        "tuning_grid": {"epochs": list(grid_epochs), "learning_rate": list(GRID_LR), "folds": FOLDS},
        "runs": {"plain": plain, "hvd_spark": hvd, "tuning_plain": tune_plain, "tuning_hvd_spark": tune_hvd},
        "horovod_spark_keras_estimator": (
            {"not_run": "bench_overhead.py runs it (main section); not repeated here"}
            if os.path.exists(LEGACY_PY)
            else {"not_run": f"{LEGACY_PY} is missing: bash benchmarks/baselines/setup.sh builds it"}
        ),
    }
    out.update(summarize(plain, hvd, tune_plain, tune_hvd))
    out["wall_s"] = time.time() - t_all
    print(table(out))
    from benchmarks.common import write

    print(f"wrote {write('small_fits' if MODEL == 'cnn' else f'small_fits_{MODEL}', out)}")
    return out


def _job_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=("plain", "hvd", "plain_tuning"), required=True)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--grid-epochs", type=int, nargs="+", default=list(GRID_EPOCHS))
    p.add_argument("--tuning", action="store_true")
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    a = p.parse_args(argv)
    global MODEL
    MODEL = a.model
    jobs = {"plain": job_plain, "hvd": job_hvd, "plain_tuning": job_plain_tuning}
    print(json.dumps(jobs[a.job](a)), flush=True)


if __name__ == "__main__":
    if "--job" in sys.argv:
        _job_main(sys.argv[1:])
        sys.stdout.flush()
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 epochs (tuning: 1 and 2), a smoke test")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each job, alternated (default 1)")
    ap.add_argument("--no-tuning", action="store_true", help="leave out the CrossValidator part (about 2 minutes)")
    ap.add_argument(
        "--model",
        choices=("cnn", "mlp"),
        default="cnn",
        help="cnn: the README job's digits_model() (results/small_fits.json); mlp: 64-64-10, as the issue first "
        "measured (results/small_fits_mlp.json)",
    )
    args = ap.parse_args()
    MODEL = args.model
    main(args.quick, args.repeats, not args.no_tuning)
