"""A lease's holder on the same host is judged by its process, not only by its heartbeat (issue 47.4):
a fit whose driver died (kill -9, or a SIGTERM before the clean-up existed) left a fresh lease, and the
next driver was refused for 60 s. Other hosts, other containers (pid namespaces) and leases that do not
say keep the heartbeat rule. Real processes: a subprocess takes the lease and is killed."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hvd_spark._internal.data import leases
from hvd_spark._internal.data.leases import LeaseHeldError
from hvd_spark._internal.data.store import Store

_HOLD = textwrap.dedent(
    """
    import sys, time
    from hvd_spark._internal.data import leases
    from hvd_spark._internal.data.store import Store
    files = Store(sys.argv[1]).files
    kind, path = sys.argv[2], sys.argv[3]
    if kind == "run":
        cm = leases.exclusive_lease(files, path, heartbeat=30, stale=60, run_id="r")
    else:
        cm = leases.lease(files, path, heartbeat=30, attempt="a")
    with cm:
        print("held", flush=True)
        time.sleep(600)
    """
)


def _held_by_a_process(root: str, kind: str, path: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, root, kind, path], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # returns at "held", or "" when the process ended first
    assert line.strip() == "held", f"the lease holder's process did not start (exit code {proc.poll()})"
    return proc


def _killed(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_a_run_lease_whose_holder_died_on_this_host_is_taken_over_at_once(tmp_path):
    store = Store(str(tmp_path))
    path = store.files.path("runs", "r", "_writer.json")
    holder = _held_by_a_process(str(tmp_path), "run", path)
    try:
        with pytest.raises(LeaseHeldError, match=f"pid {holder.pid}"):  # alive: refused
            with leases.exclusive_lease(store.files, path, heartbeat=1, stale=60):
                pass
    finally:
        _killed(holder)
    left = store.files.read_json(path)
    assert left["pid"] == holder.pid and time.time() - left["heartbeat"] < 60  # fresh: the old rule refused it
    t0 = time.monotonic()
    with leases.exclusive_lease(store.files, path, heartbeat=1, stale=60) as lease:
        taken = time.monotonic() - t0
        assert store.files.read_json(path)["token"] == lease.token
    print(f"a dead holder's fresh run lease taken over in {taken:.2f}s (was: refused until 60 s after its heartbeat)")


def test_a_data_lease_whose_holder_died_on_this_host_is_not_live(tmp_path):
    store = Store(str(tmp_path))
    folder = store.files.path("data", "k")
    store.files.makedirs(folder)
    holder = _held_by_a_process(str(tmp_path), "data", f"{folder}/_reading-a.json")
    try:
        assert [d["pid"] for d in leases.live_leases(store.files, folder, "_reading-", stale=60)] == [holder.pid]
    finally:
        _killed(holder)
    assert leases.live_leases(store.files, folder, "_reading-", stale=60) == []


def _doc(**changes):
    doc = dict(leases.holder_record(), heartbeat=time.time(), token="t")
    doc.update(changes)
    return doc


def test_which_holders_are_judged_by_their_process():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert not leases.holder_gone(_doc())  # this process
    assert leases.holder_gone(_doc(pid=gone.pid))  # dead here
    if leases.pid_started_at(os.getpid()) is not None:  # a pid reused by a later process (Linux)
        assert leases.holder_gone(_doc(pid_started="1"))
    # Not known to be gone: the heartbeat decides.
    assert not leases.holder_gone(_doc(pid=gone.pid, host="elsewhere"))
    assert not leases.holder_gone(_doc(pid=gone.pid, pidns="pid:[1]"))  # another container, same host name
    assert not leases.holder_gone(_doc(pid=gone.pid, boot="another-boot"))
    assert not leases.holder_gone({"host": leases.holder_record()["host"], "pid": gone.pid, "heartbeat": time.time()})


def test_a_fresh_lease_of_another_host_keeps_the_heartbeat_rule(tmp_path):
    store = Store(str(tmp_path))
    path = store.files.path("runs", "r", "_writer.json")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    store.files.write_json(path, _doc(pid=gone.pid, host="elsewhere"))
    with pytest.raises(LeaseHeldError, match="held by elsewhere"):
        with leases.exclusive_lease(store.files, path, heartbeat=1, stale=60):
            pass
    store.files.write_json(path, _doc(pid=gone.pid, host="elsewhere", heartbeat=time.time() - 61))
    with leases.exclusive_lease(store.files, path, heartbeat=1, stale=60):
        assert store.files.read_json(path)["host"] == leases.holder_record()["host"]
