"""A warm server's life (task/warm.py, common/forks.py) without TensorFlow: the server's imports are
replaced by a module of the test's that hangs, so what happens while a server imports (seconds with
TensorFlow, forever when an import hangs) can be seen: it watches the process it serves from its first
instant, it has a deadline, it cleans its files when it stops, a new server sweeps dead ones' files,
a task does not wait for a server past its bound, and a rank whose server ended says which server.

The tests measure the times they wait for (they assert no duration); ``-s`` shows them."""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hvd_spark._internal.common import forks
from hvd_spark._internal.task import warm
from hvd_spark._internal.task.watch import read_outcome

# The server's entry point, with its imports replaced by the test's module ``slow_preload``.
SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
from hvd_spark._internal.task import warm
warm.PRELOAD = ("slow_preload",)
warm._main(sys.argv[2], sys.argv[3], 30.0, int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]))
"""
# An import that takes forever (it marks that it began).
SLOW_PRELOAD = """
import os, time
open(os.path.join(os.path.dirname(__file__), "import-began"), "w").close()
time.sleep(600)
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return forks.home()


def _start(home: str, tmp_path, fp: str, watch: int, deadline: float = 60.0) -> None:
    """Starts a server as a task does (its starter forks it and leaves), watching ``watch``."""
    (tmp_path / "slow_preload.py").write_text(SLOW_PRELOAD)
    started = forks.create_time(watch)
    with open(os.path.join(home, f"{fp}.log"), "ab") as log:
        args = [str(tmp_path), home, fp, str(watch), repr(started if started is not None else 0.0), str(deadline)]
        subprocess.run([sys.executable, "-c", SERVER, *args], stdout=log, stderr=log, timeout=60, check=True)


def _gone(home: str, fp: str, limit: float = 30.0) -> float:
    """Seconds until no server holds ``fp``'s lock (``limit`` when one still does then)."""
    began = time.monotonic()
    while forks.held(os.path.join(home, f"{fp}.lock")) and time.monotonic() - began < limit:
        time.sleep(0.05)
    return time.monotonic() - began


def _files(home: str, fp: str) -> list[str]:
    return sorted(n for n in os.listdir(home) if n.startswith(fp))


def _wait_for(path, limit: float = 30.0) -> None:
    began = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - began < limit:
        time.sleep(0.05)
    assert os.path.exists(path), f"{path} did not appear within {limit} s"


def test_a_server_watches_its_process_while_it_imports(home, tmp_path):
    """The application stops while its server imports (TensorFlow: 3.5 s): the server ends then, not
    after its imports (which here never end), and leaves no file behind."""
    watched = subprocess.Popen(["sleep", "60"])
    _start(home, tmp_path, "aaa", watched.pid)
    _wait_for(tmp_path / "import-began")
    assert forks.held(os.path.join(home, "aaa.lock"))
    watched.kill()
    watched.wait()
    took = _gone(home, "aaa")
    print(f"\nserver gone {took:.2f} s after the process it serves")
    assert not forks.held(os.path.join(home, "aaa.lock")), "the server outlived the process it serves"
    assert _files(home, "aaa") == []


def test_a_server_whose_process_is_already_gone_ends_before_importing(home, tmp_path):
    watched = subprocess.Popen(["true"])
    started = forks.create_time(watched.pid)
    watched.wait()
    (tmp_path / "slow_preload.py").write_text(SLOW_PRELOAD)
    with open(os.path.join(home, "bbb.log"), "ab") as log:
        args = [str(tmp_path), home, "bbb", str(watched.pid), repr(started or 1.0), "60"]
        subprocess.run([sys.executable, "-c", SERVER, *args], stdout=log, stderr=log, timeout=60, check=True)
    _gone(home, "bbb")
    assert not (tmp_path / "import-began").exists(), "the server imported for a process that was gone"
    assert _files(home, "bbb") == []


def test_a_server_past_its_import_deadline_ends_and_keeps_its_log(home, tmp_path):
    _start(home, tmp_path, "ccc", os.getpid(), deadline=1.0)
    took = _gone(home, "ccc")
    print(f"\nserver with a 1 s import deadline gone after {took:.2f} s")
    assert not forks.held(os.path.join(home, "ccc.lock"))
    assert _files(home, "ccc") == ["ccc.log"]  # its log stays, for the task's warning
    assert "HVD_SPARK_WARM_START_TIMEOUT" in forks.log_tail(home, "ccc")


def test_a_task_does_not_wait_past_its_bound_for_a_server_that_is_not_ready(home, monkeypatch):
    """A server that never gets ready (it holds its lock, it never listens): the task starts its rank
    cold after HVD_SPARK_WARM_START_TIMEOUT, not after its start_timeout, and says so."""
    lock = os.open(os.path.join(home, "ddd.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    monkeypatch.setattr(warm, "ensure_server", lambda env, app="": "ddd")
    said: list[str] = []
    result: list = []
    env = {"HVD_SPARK_WARM_START_TIMEOUT": "1"}
    began = time.monotonic()
    t = threading.Thread(
        target=lambda: result.append(
            warm.spawn(warm.Payload("x", "os:getpid"), env, home, "app", 600.0, say=said.append)
        )
    )
    t.start()
    t.join(30)
    os.close(lock)
    print(f"\nthe task gave up on the server after {time.monotonic() - began:.2f} s")
    assert result == [None], "the task still waits for a warm server that is not ready"
    assert len(said) == 1 and "warm server ddd not ready after 1 s (HVD_SPARK_WARM_START_TIMEOUT=1" in said[0]
    assert "starts cold" in said[0]


def _serve(home: str, fp: str, idle: float = 30.0) -> subprocess.Popen:
    code = (
        "import sys; from hvd_spark._internal.common import forks; from hvd_spark._internal.task import procs, warm; "
        f"procs.load_prctl(); warm._Server({home!r}, {fp!r}, {idle}, {os.getpid()}, forks.create_time({os.getpid()}))"
        ".serve()"
    )
    with open(os.path.join(home, f"{fp}.lock"), "ab"), open(os.path.join(home, f"{fp}.log"), "ab") as log:
        server = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log)
    _wait_for(os.path.join(home, f"{fp}.sock"))
    return server


def test_a_server_that_stops_removes_its_files(home):
    server = _serve(home, "eee", idle=0.5)
    assert server.wait(30) == 0
    assert _files(home, "eee") == []


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_whose_server_ends_names_the_server(home, monkeypatch, how):
    server = _serve(home, "fff")
    monkeypatch.setattr(warm, "ensure_server", lambda env, app="": "fff")
    proc = warm.spawn(forks.Payload("sleep", "time:sleep"), {}, home, "app", 30.0, args=(60,))
    assert proc is not None
    server.send_signal(signal.SIGKILL if how == "killed" else signal.SIGTERM)
    server.wait(30)
    assert proc.wait(30) == -signal.SIGKILL
    outcome = read_outcome(home, 0, proc.returncode, False, [], proc.server_cause())
    print(f"\n{outcome.type}: {outcome.message}")
    assert f"the warm server fff (pid {server.pid}) that forked this rank" in outcome.message
    assert ("was killed" if how == "killed" else "stopped (SIGTERM)") in outcome.message


def test_a_new_server_sweeps_the_files_of_dead_ones(home):
    old = time.time() - 3600
    for fp in ("dead", "live", "new"):
        for suffix in (".sock", ".json", ".lock", ".log"):
            path = os.path.join(home, fp + suffix)
            open(path, "w").close()
            if fp != "new":  # a server being started has just touched its log
                os.utime(path, (old, old))
    live = os.open(os.path.join(home, "live.lock"), os.O_RDWR)
    fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert forks.sweep_stale(home, keep="mine") == ["dead"]
    finally:
        os.close(live)
    assert sorted(os.listdir(home)) == sorted(
        f"{fp}{s}" for fp in ("live", "new") for s in (".sock", ".json", ".lock", ".log")
    )


def test_a_server_takes_a_lock_whose_file_a_sweep_removed(home):
    """A sweep removes a dead server's lock file while a new server of that fingerprint opens it:
    the new server ends up holding the lock of the file at the path (never two servers)."""
    path = os.path.join(home, "ggg.lock")
    open(path, "w").close()
    sweeper = os.open(path, os.O_RDONLY)
    fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    threading.Timer(0.2, lambda: (os.unlink(path), os.close(sweeper))).start()
    fd = forks.take_lock(path)
    assert fd is not None
    try:
        assert os.fstat(fd).st_ino == os.stat(path).st_ino and forks.held(path)
    finally:
        os.close(fd)


def test_torchs_per_job_variables_do_not_key_a_server():
    """Every job's ranks get their own MASTER_PORT, RANK, ... (topology.torch_env): read by torch after
    the fork, they must not start a server per job, nor reach the server's environment."""
    from hvd_spark._internal.common.topology import RankInfo, torch_env

    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    for port, rank in ((41000, 0), (42000, 1)):
        info = RankInfo(rank, 2, rank, 2, 0, 1, "127.0.0.1")
        job = torch_env(info, node=0, nodes=1, master_addr="127.0.0.1", master_port=port, run_id=f"r{port}", iface="lo")
        env = {**base, **job}
        assert warm.fingerprint(env, "app") == warm.fingerprint(base, "app")
        assert warm.server_env(env) == base
    assert warm.fingerprint({**base, "OMP_NUM_THREADS": "3"}, "app") != warm.fingerprint(base, "app")
