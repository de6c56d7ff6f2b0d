"""The driver service over real sockets: the token check, the message kinds, broadcast."""

import time

import pytest

from hvd_spark._internal.driver.service import KIND, DriverService, Kind, TaskClient


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class _Clock:
    """A monotonic clock that moves only when a test moves it, put in the place of a module's ``time``
    so that silence and stall decisions are checked without waiting for them. ``reads`` counts the
    calls to ``monotonic`` (a watchdog thread's checks show up there)."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def monotonic(self):
        self.reads += 1
        return self.now

    def time(self):
        return time.time()

    def sleep(self, seconds):
        time.sleep(seconds)


@pytest.fixture
def clock(monkeypatch):
    from hvd_spark._internal.driver import service as service_module
    from hvd_spark._internal.task import barrier

    c = _Clock()
    monkeypatch.setattr(service_module, "time", c)
    monkeypatch.setattr(barrier, "time", c)
    return c


@pytest.fixture
def service():
    events = []
    svc = DriverService(2, on_event=lambda rank, payload: events.append((rank, payload)), bind="127.0.0.1")
    svc.start()
    svc.events = events
    yield svc
    svc.stop()


def test_messages_reach_the_driver_and_broadcast_reaches_tasks(service):
    addr = f"127.0.0.1:{service.port}"
    task = TaskClient(addr, service.token, {"role": "task", "partition": 1})
    rank = TaskClient(addr, service.token, {"role": "rank", "rank": 0})
    task.send({KIND: Kind.RANK, "rank": 0})
    rank.send({KIND: Kind.EVENT, "rank": 0, "payload": {"epoch": 1}})
    task.send({KIND: Kind.FAIL, "rank": 0, "type": "ValueError", "message": "bad"})
    task.send({KIND: Kind.DONE, "rank": 0, "ok": False})
    _until(lambda: service.snapshot()[2])
    started, rank_of_partition, done, failures, connected = service.snapshot()
    assert set(started) == {1} and rank_of_partition == {1: 0} and connected == {1}  # a rank is not a task
    assert done[0]["ok"] is False and failures[0]["message"] == "bad" and "received" in failures[0]
    _until(lambda: service.events)
    assert service.events == [(0, {"epoch": 1})]
    service.broadcast({KIND: Kind.ABORT, "reason": "stop"})
    msg = next(task.messages())
    assert msg[KIND] == Kind.ABORT and msg["reason"] == "stop"
    task.close()
    rank.close()
    _until(lambda: not service.snapshot()[4])


def test_a_connection_without_the_token_is_dropped(service):
    intruder = TaskClient(f"127.0.0.1:{service.port}", "not-the-token", {"role": "task", "partition": 0})
    intruder.send({KIND: Kind.DONE, "rank": 0, "ok": True})
    assert list(intruder.messages()) == []  # the driver closed the connection
    assert service.snapshot()[0] == {} and service.snapshot()[2] == {}


def test_a_failing_progress_callback_does_not_break_the_service():
    svc = DriverService(1, on_event=lambda rank, payload: 1 / 0, bind="127.0.0.1")
    svc.start()
    try:
        c = TaskClient(f"127.0.0.1:{svc.port}", svc.token, {"role": "task", "partition": 0})
        c.send({KIND: Kind.EVENT, "rank": 0, "payload": {}})
        c.send({KIND: Kind.DONE, "rank": 0, "ok": True})
        _until(lambda: svc.snapshot()[2])
        assert svc.snapshot()[2][0]["ok"] is True  # the message after the failing callback was handled
        assert svc.snapshot()[4] == {0}  # and the connection is still open
        c.close()
    finally:
        svc.stop()


def test_a_task_that_stops_sending_is_reported_silent_with_its_host(clock, service):
    addr = f"127.0.0.1:{service.port}"
    quiet = TaskClient(addr, service.token, {"role": "task", "partition": 0})
    beating = TaskClient(addr, service.token, {"role": "task", "partition": 1})
    quiet.send({KIND: Kind.RANK, "rank": 0})
    beating.send({KIND: Kind.RANK, "rank": 1})
    _until(lambda: len(service.snapshot()[1]) == 2)
    assert service.silent_tasks(0.5) == []
    clock.now += 0.75  # partition 1 beats, partition 0 says nothing
    beating.send({KIND: Kind.BEAT})
    _until(lambda: service.last_heard[1] == clock.now)
    silent = service.silent_tasks(0.5)
    assert silent == [(0, 0, "127.0.0.1", 0.75)]
    assert service.silent_tasks(0.75) == []  # not silent for longer than it was
    # A rank that finished may go quiet (rank 0's task serves the rendezvous until the end).
    quiet.send({KIND: Kind.DONE, "rank": 0, "ok": True})
    _until(lambda: 0 in service.snapshot()[2])
    clock.now += 0.75
    assert [p for p, *_ in service.silent_tasks(0.5)] == [1]
    quiet.close()
    beating.close()


def test_a_task_cut_off_from_the_driver_stops_its_rank(clock):
    from hvd_spark._internal.task.barrier import _Watch

    svc = DriverService(1, bind="127.0.0.1")
    svc.start()
    try:
        client = TaskClient(f"127.0.0.1:{svc.port}", svc.token, {"role": "task", "partition": 0})
        watch = _Watch(client, 0, silence_limit=1.0)
        _until(lambda: svc.snapshot()[4] == {0})  # the service knows the task: a broadcast reaches it
        clock.now += 0.75
        svc.broadcast({KIND: Kind.BEAT})  # a heartbeat resets the silence
        _until(lambda: watch.last_heard == clock.now)
        clock.now += 1.0  # 1.75 s after the start, 1 s after the beat: not over the limit
        reads = clock.reads
        _until(lambda: clock.reads > reads + 1)  # the watchdog looked at the clock again
        assert not watch.abort.is_set()
        clock.now += 0.25  # 1.25 s after the beat
        assert watch.abort.wait(10.0)
        assert watch.abort_reason == "no word from the driver for 1 s (this host was cut off)"
        client.close()
    finally:
        svc.stop()


def test_tf_notices_are_recognized_and_the_users_level_wins(monkeypatch):
    from hvd_spark._internal.common import logs

    assert logs.is_tf_notice(
        "I0000 00:00:1795399587.622207    3804 port.cc:153] oneDNN custom operations are on. You may see ..."
    )
    assert logs.is_tf_notice("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
    assert logs.is_tf_notice("To enable the following instructions: AVX2 FMA, in other operations, rebuild ...")
    assert not logs.is_tf_notice("E0000 00:00:1795399587.622207    3804 op.cc:12] a real error")
    assert not logs.is_tf_notice("epoch 1/3 - loss: 0.5")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert logs.rank_env_defaults(None) == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    assert logs.rank_env_defaults({"A": "b"}) == {"A": "b", "TF_CPP_MIN_LOG_LEVEL": "1"}  # the driver's
    assert logs.rank_env_defaults({"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"  # env= wins
    assert logs.tf_quiet({"TF_CPP_MIN_LOG_LEVEL": "2"}) and not logs.tf_quiet({"TF_CPP_MIN_LOG_LEVEL": "0"})


def test_tf_notices_written_to_fd_2_during_an_import_are_dropped(monkeypatch, capfd):
    """transform's Python workers: TF writes its start-up notices to fd 2 (not through sys.stderr),
    whatever TF_CPP_MIN_LOG_LEVEL says; they are dropped, other lines pass, unless the level is 0."""
    import os
    import sys

    from hvd_spark._internal.common import logs

    notice = b"I0000 00:00:1795399587.622207    3804 port.cc:153] oneDNN custom operations are on.\n"
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # as in a fresh Python worker
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with logs.tf_notices_dropped():
        os.write(2, notice + b"a line of the user's\n")
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
    assert capfd.readouterr().err == "a line of the user's\n"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # asked for everything
    with logs.tf_notices_dropped():
        os.write(2, notice)
    assert capfd.readouterr().err == notice.decode()


def _gather_in_thread(client, round_name, info, results, silence=30.0):
    import threading

    def run():
        try:
            results[info] = client.gather(round_name, info, silence)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[info] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_gather_returns_every_task_s_info_in_partition_order(service):
    from hvd_spark._internal.driver.service import JobAborted

    addr = f"127.0.0.1:{service.port}"
    first = TaskClient(addr, service.token, {"role": "task", "partition": 1})
    results: dict = {}
    t1 = _gather_in_thread(first, "hosts", "from-1", results)
    _until(lambda: service._gathers.get("hosts"))  # the driver has it ...
    assert "from-1" not in results  # ... and the task waits for the other task
    # A task that contributes and then dies takes its contribution back: its replacement's counts.
    dead = TaskClient(addr, service.token, {"role": "task", "partition": 0})
    dead.send({KIND: Kind.GATHER, "round": "other", "info": "stale"})
    _until(lambda: service._gathers.get("other"))
    dead.close()
    _until(lambda: not service._gathers.get("other"))
    second = TaskClient(addr, service.token, {"role": "task", "partition": 0})
    t0 = _gather_in_thread(second, "hosts", "from-0", results)
    t0.join(10)
    t1.join(10)
    assert results == {"from-0": ["from-0", "from-1"], "from-1": ["from-0", "from-1"]}
    # The connection goes on after a gather: the next messages still arrive.
    service.broadcast({KIND: Kind.ALL_DONE})
    assert next(first.messages())[KIND] == Kind.ALL_DONE
    # An abort while waiting raises; so does a driver that says nothing for the silence limit.
    second.close()
    _until(lambda: service.snapshot()[4] == {1})
    t = _gather_in_thread(first, "late", "a", results)
    _until(lambda: service._gathers.get("late"))
    service.broadcast({KIND: Kind.ABORT, "reason": "tasks did not start"})
    t.join(10)
    assert isinstance(results["a"], JobAborted) and "did not start" in str(results["a"])
    third = TaskClient(addr, service.token, {"role": "task", "partition": 0})
    t = _gather_in_thread(third, "later", "b", results, silence=0.5)
    t.join(10)
    assert isinstance(results["b"], ConnectionError) and "silent for 0.5 s" in str(results["b"])
    first.close()
    third.close()


def test_the_job_is_stalled_only_when_no_unfinished_rank_moves(clock, service):
    addr = f"127.0.0.1:{service.port}"
    tasks = [TaskClient(addr, service.token, {"role": "task", "partition": p}) for p in (0, 1)]
    ranks = [TaskClient(addr, service.token, {"role": "rank", "rank": r}) for r in (0, 1)]
    for r, task in enumerate(tasks):
        task.send({KIND: Kind.RANK, "rank": r})
    _until(lambda: len(service.progress) == 2)
    ranks[1].send({KIND: Kind.PROGRESS, "rank": 1, "count": 5, "where": "epoch 1 step 5"})
    _until(lambda: service.progress[1][1] == 5)
    clock.now += 0.25
    ranks[0].send({KIND: Kind.PROGRESS, "rank": 0, "count": 7, "where": "epoch 1 step 7"})
    _until(lambda: service.progress[0][1] == 7)
    assert service.stalled_ranks(60) == []
    clock.now += 0.25
    ranks[0].send({KIND: Kind.PROGRESS, "rank": 0, "count": 7, "where": "again"})  # the same count: no progress
    ranks[0].send({KIND: Kind.EVENT, "rank": 0, "payload": {"after": "again"}})  # same connection: read after it
    _until(lambda: service.events)
    stalled = service.stalled_ranks(0.1)
    assert stalled == [
        (1, 0.5, 5, "epoch 1 step 5"),
        (0, 0.25, 7, "epoch 1 step 7"),
    ]  # the longest silent first
    assert service.stalled_ranks(0.25) == []  # rank 0 moved 0.25 s ago: not stalled for longer
    ranks[0].send({KIND: Kind.PROGRESS, "rank": 0, "count": 8, "where": "epoch 1 step 8"})
    _until(lambda: service.progress[0][1] == 8)
    assert service.stalled_ranks(0.1) == []  # rank 0 moves: the job is alive (rank 1 may be slow)
    tasks[0].send({KIND: Kind.DONE, "rank": 0, "ok": True})
    _until(lambda: 0 in service.snapshot()[2])
    clock.now += 0.2
    assert [r for r, *_ in service.stalled_ranks(0.1)] == [1]  # the finished rank is out of it
    for c in tasks + ranks:
        c.close()
