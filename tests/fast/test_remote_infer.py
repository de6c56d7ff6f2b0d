"""Predictions in a warm server's child (infer/remote.py, infer/child.py, common/forks.py,
task/warm.py): which server a UDF worker may use, the request / reply protocol, errors, and what
happens when the child is gone.

No TensorFlow here: the child's loop runs in a thread over a real socket pair, with the model
loading and the prediction replaced by stand-ins (the Spark tests in test_warm.py run the real ones)."""

import fcntl
import json
import os
import socket
import sys
import threading

import numpy as np
import pytest

from hvd_spark._internal.common import forks
from hvd_spark._internal.infer import batching, cache, child, remote
from hvd_spark._internal.task import warm


@pytest.fixture
def home(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return forks.home()


def _server_files(home: str, fp: str, env: dict, app: str, held: bool):
    with open(os.path.join(home, f"{fp}.json"), "w") as f:
        json.dump({"python": sys.executable, "app": app, "pid": 1, "env_key": forks.infer_key(env)}, f)
    fd = os.open(os.path.join(home, f"{fp}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    if held:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_worker_finds_the_live_server_of_its_application_with_its_environment(home):
    env = {"PATH": "/bin", "SPARK_SIMPLIFIED_TRACEBACK": "1", "OMP_NUM_THREADS": "1"}
    fds = [_server_files(home, "aaa", dict(env, OMP_NUM_THREADS="4"), "app-1", held=True)]
    try:
        # Variables Spark sets per worker pool, or read after the fork, do not count ...
        assert forks.find_server(dict(env, SPARK_SIMPLIFIED_TRACEBACK="0"), "app-1") == "aaa"
        # ... any other difference does, and so do the application and a live server.
        assert forks.find_server(dict(env, TF_ENABLE_ONEDNN_OPTS="0"), "app-1") is None
        assert forks.find_server(dict(env, PATH="/usr/bin"), "app-1") is None
        assert forks.find_server(env, "app-2") is None
        fds.append(_server_files(home, "bbb", env, "app-2", held=False))  # its server is gone
        assert forks.find_server(env, "app-2") is None
    finally:
        for fd in fds:
            os.close(fd)


def test_a_server_describes_itself_without_the_values_of_its_environment(home, monkeypatch):
    monkeypatch.setenv("HVD_SPARK_TEST_SECRET", "s3cr3t-value")
    warm._Server(home, "ccc", 1.0, os.getpid(), forks.create_time(os.getpid()), "app-3")._describe()
    with open(os.path.join(home, "ccc.json")) as f:
        assert "s3cr3t-value" not in f.read()  # a digest, not the values (credentials live there)
    fd = os.open(os.path.join(home, "ccc.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert forks.find_server(dict(os.environ, PYTHONUNBUFFERED="1"), "app-3") == "ccc"
        assert forks.find_server(dict(os.environ, HVD_SPARK_TEST_SECRET="other"), "app-3") is None
    finally:
        os.close(fd)


@pytest.fixture
def stand_ins(monkeypatch):
    """The child loads a stand-in model and predicts ``model.value`` for every row."""

    class Model:
        def __init__(self, value):
            self.value = value

    def load_model(url, opts, co_bytes, num_threads, device=None):
        if url.endswith("missing.keras"):
            raise FileNotFoundError(f"No such file: {url}")
        return Model(float(num_threads))

    def predict_columns(model, cols, n, inputs, outputs, batch_size, names=None):
        if isinstance(model, remote.RemoteModel):
            return model.predict_columns(cols, n, inputs, outputs, batch_size, names)
        return [np.full((n, 1), model.value)]

    monkeypatch.setattr(cache, "load_model", load_model)
    monkeypatch.setattr(batching, "predict_columns", predict_columns)
    return Model


def _child():
    """A RemoteModel talking to the child's loop in a thread; (model, thread)."""
    mine, theirs = socket.socketpair()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", child.serve(theirs.detach())), daemon=True)
    t.start()
    conn, _ = socket.socketpair()  # stands for the connection to the server
    return remote.RemoteModel(mine, conn, pid=12345), t, out


def test_the_child_loads_predicts_and_ends_when_the_worker_closes(stand_ins):
    model, t, out = _child()
    model.call(("load", "file:///m.keras", {}, None, 3), 10, "loading")
    got = model.predict_columns([np.arange(4)], 4, [], [], 2, ["x"])
    assert [a.tolist() for a in got] == [[[3.0]] * 4]
    model.close()
    t.join(10)
    assert out == {"rc": 0}


def test_an_error_in_the_child_is_raised_in_the_worker_with_the_childs_traceback(stand_ins):
    model, t, _ = _child()
    with pytest.raises(FileNotFoundError, match="missing.keras") as info:
        model.call(("load", "file:///missing.keras", {}, None, 1), 10, "loading the model")
    assert any("inference process 12345" in n and "Traceback" in n for n in info.value.__notes__)
    with pytest.raises(RuntimeError, match="predict before load"):
        model.predict_columns([np.arange(2)], 2, [], [], 2, ["x"])
    model.close()
    t.join(10)


def test_a_child_that_is_gone_is_replaced_and_the_task_goes_on(stand_ins):
    mine, theirs = socket.socketpair()
    theirs.close()  # the child died (killed, or its server ended)
    conn, _ = socket.socketpair()
    model = remote.RemoteModel(mine, conn, pid=999)
    with pytest.raises(remote.RemoteGone, match="inference process 999"):
        model.call(("load", "file:///m.keras", {}, None, 1), 10, "loading the model")
    model = remote.RemoteModel(*socket.socketpair(), pid=998)
    model.sock.close()
    model.reload = lambda: stand_ins(5.0)
    got = model.predict_columns([np.arange(3)], 3, [], [], 2, ["x"])
    assert [a.ravel().tolist() for a in got] == [[5.0, 5.0, 5.0]]


def test_a_silent_child_is_reported_by_pid_after_the_timeout():
    mine, theirs = socket.socketpair()  # nobody answers on the other end
    conn, _ = socket.socketpair()
    model = remote.RemoteModel(mine, conn, pid=4242)
    with pytest.raises(remote.RemoteGone, match=r"4242 .* did not answer within 0 s while loading the model"):
        model.call(("load", "file:///m.keras", {}, None, 1), 0.2, "loading the model")
    theirs.close()


class _Picky(Exception):
    """An exception that does not rebuild from its pickle (its __init__ takes two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"picky {a} {b}")


def test_an_exception_that_does_not_rebuild_keeps_its_type_message_and_traceback(stand_ins, monkeypatch):
    def load_model(*args, **kwargs):
        raise _Picky(1, 2)

    monkeypatch.setattr(cache, "load_model", load_model)
    model, t, _ = _child()
    with pytest.raises(RuntimeError, match=r"_Picky: picky 1 2") as info:
        model.call(("load", "file:///m.keras", {}, None, 1), 10, "loading the model")
    assert any("load_model" in n for n in info.value.__notes__)  # the child's traceback
    model.close()
    t.join(10)


def test_a_worker_keeps_one_model_and_replaces_a_broken_remote_one(stand_ins, monkeypatch):
    opened = []

    def open_model(app, url, opts, co_bytes, num_threads):
        m = remote.RemoteModel(*socket.socketpair(), pid=100 + len(opened))
        opened.append(m)
        return m

    monkeypatch.setattr(remote, "open_model", open_model)
    monkeypatch.setattr(cache, "_MODEL_CACHE", {})
    first = cache.load_cached("v1", "file:///m.keras", {}, None, 1, None, "app")
    assert cache.load_cached("v1", "file:///m.keras", {}, None, 1, None, "app") is first
    first.broken = True  # its process went away during a task
    second = cache.load_cached("v1", "file:///m.keras", {}, None, 1, None, "app")
    assert second is not first and len(opened) == 2
    third = cache.load_cached("v2", "file:///m.keras", {}, None, 1, None, "app")  # a newer model version
    assert second.broken and not third.broken  # the older one's process was told to end
    here = cache.load_cached("v2", "file:///m.keras", {}, None, 4, None, None)  # warm off: loaded here
    assert isinstance(here, stand_ins) and third.broken
    assert first.reload is not None and isinstance(first.reload(), stand_ins)  # a gone child: this worker


def test_a_udf_worker_predicting_remotely_does_not_import_tensorflow():
    import subprocess

    code = (
        "import sys\n"
        "from hvd_spark._internal.infer import cache, remote, batching\n"
        "from hvd_spark._internal.ml import transformer\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'imported TF'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _forked_output(conn: socket.socket, read_end: int) -> tuple[bytes, dict]:
    """What a forked child wrote, and its exit as its server reported it."""
    with os.fdopen(read_end, "rb") as out:
        text = out.read()
    conn.settimeout(10)
    reply = json.loads(conn.recv(4096).split(b"\n")[0])
    conn.close()
    return text, reply


def test_a_server_forks_the_payload_a_request_names(home):
    """The server knows no payload: its child runs the ``module:function`` the request carries, with
    its arguments; a request whose descriptors do not match its payload is refused."""
    import subprocess
    import time

    code = (
        "from hvd_spark._internal.common import forks; from hvd_spark._internal.task import procs, warm; "
        f"procs.load_prctl(); warm._Server({home!r}, 'ddd', 30.0, {os.getpid()}, "
        f"forks.create_time({os.getpid()})).serve()"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    sock = os.path.join(home, "ddd.sock")
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        payload = forks.Payload("test", "builtins:print")
        read_end, write_end = os.pipe()
        conn, _ = forks.fork("ddd", payload, env=dict(os.environ), workdir=home, out_fd=write_end, args=["hi", 3])
        os.close(write_end)
        assert _forked_output(conn, read_end) == (b"hi 3\n", {"rc": 0})  # print returns None: a good end

        read_end, write_end = os.pipe()
        conn, _ = forks.fork(
            "ddd", forks.Payload("test", "operator:add"), env={}, workdir=home, out_fd=write_end, args=[2, 3]
        )
        os.close(write_end)
        assert _forked_output(conn, read_end) == (b"", {"rc": 5})  # what the function returns is the exit code

        bad = forks.connect(sock)
        assert bad is not None
        request = {"payload": {"name": "x", "target": "os:getpid"}, "env": {}, "workdir": home}
        socket.send_fds(bad, [json.dumps(request).encode() + b"\n"], [1, 2])  # one descriptor too many
        bad.settimeout(10)
        assert bad.recv(4096) == b""  # refused: closed without a child
        bad.close()
    finally:
        server.terminate()
        server.wait(10)
    with pytest.raises(ValueError, match="module:function"):
        forks.Payload("x", "no_function_here")
    with pytest.raises(ValueError, match="15 bytes"):
        forks.Payload("a-name-too-long", "os:getpid")
