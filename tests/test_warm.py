"""Warm ranks (hvd_spark/_internal/task/warm.py): real Spark, real fork servers, real Horovod over Gloo.

What must hold: a later job's ranks come from the server the first job started (TF already
imported), each job still runs in processes of its own (nothing of the previous job is left in
them), results are the same as in fresh processes, and no server outlives its application."""

import contextlib
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import psutil
import pytest

import hvd_spark
from hvd_spark import HorovodEstimator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from digits import digits_frames, digits_model  # noqa: E402

SERVER = "hvd_spark._internal.task.warm"


def _servers() -> list[psutil.Process]:
    """The servers alone: their forked ranks and inference processes share their command line, not their name."""
    from hvd_spark._internal.infer.remote import INFER_NAME
    from hvd_spark._internal.task.barrier import RANK_NAME

    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) > 2 and cmd[1:3] == ["-m", SERVER] and p.info["name"] not in (RANK_NAME, INFER_NAME):
            found.append(p)
    return found


def probe(marker: str):
    """What a rank can tell about its process: who started it, what was imported before its job,
    and whether a previous job's state is still there."""
    import builtins

    preloaded = "tensorflow" in sys.modules and "horovod.tensorflow" in sys.modules
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    leftover = getattr(builtins, "_hvd_spark_test_marker", None)
    builtins._hvd_spark_test_marker = marker  # a later job in the same process would see it
    total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum).numpy().tolist()
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "preloaded": preloaded,
        "leftover": leftover,
        "sum": total,
        "random": float(np.random.random()),
        "name": open("/proc/self/comm").read().strip(),
    }


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_later_jobs_fork_from_one_warm_server_into_fresh_processes(spark):
    first = hvd_spark.run(probe, args=("first",), num_proc=2, spark=spark, verbose=0, warm=True)
    second = hvd_spark.run(probe, args=("second",), num_proc=2, spark=spark, verbose=0, warm=True)
    for r in first + second:
        assert r["sum"] == [3.0]
        assert r["leftover"] is None  # a process of its own: nothing of the first job
    # Both jobs' ranks are children of one server, which had imported TF and Horovod before them.
    parents = {r["ppid"] for r in first + second}
    assert len(parents) == 1
    server = psutil.Process(parents.pop())
    assert server.cmdline()[1:3] == ["-m", SERVER]
    assert all(r["preloaded"] for r in second)
    assert {r["name"] for r in first + second} == {"hvd_spark-rank"}  # told apart from their server by name
    assert len({r["pid"] for r in first + second}) == 4
    # Forked ranks draw their own NumPy random state, as fresh processes do.
    assert len({r["random"] for r in first + second}) == 4

    cold = hvd_spark.run(probe, args=("cold",), num_proc=2, spark=spark, verbose=0, warm=False)
    assert all(not r["preloaded"] and r["ppid"] != server.pid for r in cold)
    assert [r["sum"] for r in cold] == [[3.0], [3.0]]


def failing_probe():
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(7)  # dies without a result
    raise_at = os.environ.get("HVD_SPARK_RANK")
    raise RuntimeError(f"rank {raise_at} raised on purpose")


def test_a_warm_rank_that_dies_or_raises_is_reported_as_a_fresh_one_would_be(spark):
    hvd_spark.run(probe, args=("x",), num_proc=2, spark=spark, verbose=0, warm=True)
    with pytest.raises(hvd_spark.RankFailedError) as info:
        hvd_spark.run(failing_probe, num_proc=2, spark=spark, verbose=0, warm=True)
    # Either failure may come first; the one reported is a real one, with its own rank's message.
    err = info.value
    expected = {0: ("RuntimeError", "rank 0 raised on purpose"), 1: ("ProcessDied", "exited with code 7")}
    assert err.rank in expected and err.exc_type == expected[err.rank][0] and expected[err.rank][1] in str(err)
    # The server is still serving: the next job is warm again.
    after = hvd_spark.run(probe, args=("after",), num_proc=2, spark=spark, verbose=0, warm=True)
    assert all(r["preloaded"] and r["sum"] == [3.0] for r in after)


def sleeper(flag: str):
    open(flag, "w").close()
    import time

    time.sleep(120)


def test_a_rank_whose_warm_server_was_killed_names_the_server(spark, tmp_path):
    import threading
    import time

    server = hvd_spark.run(probe, args=("k",), num_proc=2, spark=spark, verbose=0, warm=True)[0]["ppid"]
    flag, failed = tmp_path / "started", []

    def job():
        try:
            hvd_spark.run(sleeper, args=(str(flag),), num_proc=2, spark=spark, verbose=0, warm=True)
        except hvd_spark.RankFailedError as e:
            failed.append(e)

    t = threading.Thread(target=job)
    t.start()
    deadline = time.monotonic() + 120
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(server, 9)
    t.join(120)
    assert failed, "the job did not fail with RankFailedError"
    print(f"\n{str(failed[0]).splitlines()[0]}")
    assert "the warm server" in str(failed[0]) and f"(pid {server}) that forked this rank was killed" in str(failed[0])


def _digits_fit(train, store, seed, model_fn, warm: bool, monkeypatch):
    monkeypatch.setenv("HVD_SPARK_WARM", "1" if warm else "0")
    keras.utils.set_random_seed(seed)
    est = HorovodEstimator(
        num_proc=2,
        store=store,
        model=model_fn(),
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        random_seed=seed,
        verbose=0,
    )
    return est.fit(train)


def _mlp():
    inputs = keras.Input(shape=(64,), name="pixels")
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.Dropout(0.2)(h)  # uses the random state: a leak would change the weights
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))


def test_consecutive_fits_of_different_models_match_fresh_processes(spark, tmp_path, monkeypatch):
    train, _ = digits_frames(spark)
    train = train.cache()
    store = str(tmp_path / "store")
    # Warm: a CNN first (its graphs, Keras names and seeds would leak into the next fit if the
    # process were reused), then an MLP with Dropout.
    _digits_fit(train, store, 3, digits_model, True, monkeypatch)
    warm = _digits_fit(train, store, 5, _mlp, True, monkeypatch)
    fresh = _digits_fit(train, store, 5, _mlp, False, monkeypatch)
    w_warm, w_fresh = warm.getModel().get_weights(), fresh.getModel().get_weights()
    assert [w.shape for w in w_warm] == [w.shape for w in w_fresh]
    assert all(np.array_equal(a, b) for a, b in zip(w_warm, w_fresh)), "a warm fit trained differently"
    assert warm.getHistory()["loss"] == fresh.getHistory()["loss"]
    assert warm.getHistory()["accuracy"][-1] > 0.8


def _inference_processes() -> dict[int, int]:
    """pid -> parent pid of every process forked by a warm server to predict."""
    from hvd_spark._internal.infer.remote import INFER_NAME

    found = {}
    for p in psutil.process_iter(["name", "ppid"]):
        if p.info["name"] == INFER_NAME:
            found[p.pid] = p.info["ppid"]
    return found


def test_a_transform_after_a_fit_predicts_in_the_warm_servers_children(spark, tmp_path, monkeypatch):
    # the UDF path, whatever the frame: a small local relation or filled cache (another module's cache of the
    # same rows stands in for them) would be predicted on the driver
    monkeypatch.setenv("HVD_SPARK_DRIVER_TRANSFORM_ROWS", "0")
    train, test = digits_frames(spark)
    model = _digits_fit(train.cache(), str(tmp_path / "store"), 11, _mlp, True, monkeypatch)
    before = set(_inference_processes())

    def predicted():
        rows = model.transform(test).select("features", "probability").collect()
        return np.array([r.features for r in rows], np.float32), np.array([r.probability for r in rows])

    X, probs = predicted()
    children = {pid: ppid for pid, ppid in _inference_processes().items() if pid not in before}
    # The UDF workers did not import TensorFlow: children of the fit's warm server predicted ...
    assert children, "no inference process was forked"
    servers = {p.pid for p in _servers()}
    assert set(children.values()) <= servers
    # ... exactly what the model predicts here.
    assert len(X) == test.count()
    np.testing.assert_allclose(probs, model.getModel().predict(X, verbose=0), rtol=1e-5, atol=1e-6)
    # Children that die (killed, or gone with their server) are replaced: the next transform goes on.
    for pid in children:
        psutil.Process(pid).kill()
    X2, probs2 = predicted()
    order, order2 = np.lexsort(X.T), np.lexsort(X2.T)
    np.testing.assert_allclose(probs2[order2], probs[order], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prewarm", [True, 2])
def test_servers_end_when_idle_and_with_the_application(tmp_path, prewarm):
    """A separate application (its own driver process): local_session starts the server of a default
    fit (one rank on both cores), or with ``prewarm=2`` that of 2-rank jobs, which a later 2-rank job
    forks from instead of starting its own; an idle server ends after HVD_SPARK_WARM_IDLE seconds;
    busy ones end when the application stops."""
    script = tmp_path / "app.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time, json
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import hvd_spark
            from test_warm import probe, _servers
            import cloudpickle, test_warm
            cloudpickle.register_pickle_by_value(test_warm)
            spark = hvd_spark.local_session("local[2]", prewarm={prewarm!r})  # starts a warm server
            import psutil

            def app_of(p):  # a server or starter may exit between the listing and this read
                try:
                    return p.environ().get("HVD_SPARK_TEST_APP")
                except psutil.Error:
                    return None

            def idle_of(p):
                try:
                    return p.environ().get("HVD_SPARK_WARM_IDLE")
                except psutil.Error:
                    return None

            mine = lambda: [p.pid for p in _servers() if app_of(p) == "{tmp_path.name}"]
            # The session's server: one that stays (its starter process, of the same command line, exits).
            deadline, prewarmed, seen = time.time() + 120, [], []
            while time.time() < deadline:
                now = mine()
                prewarmed = [p for p in now if p in seen]
                if prewarmed:
                    break
                seen = now
                time.sleep(1.0)
            hvd_spark.run(probe, args=("a",), num_proc=2, verbose=0, env={{"HVD_SPARK_WARM_IDLE": "2"}})
            idle = [p.pid for p in _servers() if app_of(p) == "{tmp_path.name}" and idle_of(p) == "2"]
            assert len(idle) == 1, (prewarmed, mine())
            deadline = time.time() + 30
            while set(idle) & set(mine()) and time.time() < deadline:
                time.sleep(0.5)
            idle_gone = not set(idle) & set(mine())
            hvd_spark.run(probe, args=("b",), num_proc=2, verbose=0)
            busy = [p for p in mine() if p not in prewarmed]
            spark.stop()
            deadline = time.time() + 30
            while mine() and time.time() < deadline:
                time.sleep(0.5)
            print(json.dumps({{"prewarmed": prewarmed, "idle_gone": idle_gone, "busy": busy, "left": mine()}}))
            """
        )
    )
    env = dict(os.environ, HVD_SPARK_TEST_APP=tmp_path.name, HVD_SPARK_WARM="1")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["prewarmed"]) == 1, "local_session started no warm server (or several)"
    assert result["idle_gone"], "an idle warm server outlived HVD_SPARK_WARM_IDLE"
    # a 2-rank job forks from the session's server when it was started for 2 ranks, else from its own
    assert len(result["busy"]) == (0 if prewarm == 2 else 1), result
    assert result["left"] == [], "a warm server outlived its application"
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie" for p in result["busy"])


APP_STOPPED_EARLY = """
import json, os, sys, threading, time
import psutil
import hvd_spark

mode, marker = sys.argv[1], os.environ["HVD_SPARK_TEST_APP"]
spark = hvd_spark.local_session("local[2]", prewarm=False)
spark.sparkContext.setLogLevel("OFF")


def ours():
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            hvd = {"hvd_spark._internal.task.warm", "hvd_spark._internal.rank.entry"} & set(p.info["cmdline"] or [])
            if hvd and p.environ().get("HVD_SPARK_TEST_APP") == marker:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def work():
    try:
        if mode == "fit":
            import keras
            from hvd_spark import HorovodEstimator

            df = spark.createDataFrame([([float(i % 7), 1.0], i % 2) for i in range(256)], "x array<float>, y long")
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid")])
            HorovodEstimator(
                num_proc=2, store=sys.argv[2], model=model, optimizer="sgd", loss="binary_crossentropy",
                feature_cols=["x"], label_cols=["y"], batch_size=8, epochs=50, verbose=0,
            ).fit(df)
        else:
            hvd_spark.run(time.sleep, args=(120,), num_proc=2, verbose=0)
    except BaseException:
        pass


threading.Thread(target=work, daemon=True).start()
began, deadline = time.time(), time.time() + 240
while not ours() and time.time() < deadline:  # the first process of a warm server (it imports for seconds)
    time.sleep(0.05)
seen = ours()
threading.Timer(60, lambda: os._exit(3)).start()  # a stop that hangs would leave the test nothing to see
spark.stop()
print("RESULT " + json.dumps({"seen": seen, "after": round(time.time() - began, 2)}), flush=True)
os._exit(0)
"""


HVD_MODULES = {SERVER, "hvd_spark._internal.rank.entry"}  # on the command line of every process of hvd_spark's


@pytest.mark.parametrize("mode", ["fit", "run"])
def test_an_application_stopped_in_its_first_seconds_leaves_no_process(tmp_path, mode):
    """The application (a driver process of its own) stops as soon as its fit's or run's first warm
    server process appears, while that server imports TensorFlow: 10 s after the application ends,
    no process of hvd_spark that it started is alive (they carry the test's marker variable)."""
    import json
    import time

    marker = f"stopped-early-{mode}-{os.getpid()}-{tmp_path.name}"
    env = dict(os.environ, HVD_SPARK_TEST_APP=marker, HVD_SPARK_WARM="1", PYSPARK_PYTHON=sys.executable)
    args = [sys.executable, "-c", APP_STOPPED_EARLY, mode, str(tmp_path / "store")]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    ended = time.monotonic()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    app = json.loads(lines[-1][len("RESULT ") :])
    assert app["seen"], "the application saw no warm server start"

    def ours() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if (
                    set(p.info["cmdline"] or []) & HVD_MODULES  # a warm server, its children, a cold rank
                    and p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.environ().get("HVD_SPARK_TEST_APP") == marker
                ):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    last = 0.0
    while time.monotonic() - ended < 10.0:
        if ours():
            last = time.monotonic() - ended
        time.sleep(0.2)
    left = ours()
    print(f"\n{mode}: stopped {app['after']} s after its start; hvd_spark processes seen until {last:.1f} s after")
    for p in left:  # this test's own (by the marker): not left to run for 10 minutes
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, f"alive 10 s after their application ended: {[(p.pid, p.info['cmdline'][:3]) for p in left]}"
