"""The driver service over real sockets: the token check, the message kinds, broadcast; the stall
watchdog's order and its report."""

import dataclasses
import time

import pytest

from hvd_spark._internal.common.service import KIND, DriverService, Kind, TaskClient


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
    from hvd_spark._internal.common import service as service_module
    from hvd_spark._internal.task import watch

    c = _Clock()
    monkeypatch.setattr(service_module, "time", c)
    monkeypatch.setattr(watch, "time", c)
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
    from hvd_spark._internal.task.watch import Watch

    svc = DriverService(1, bind="127.0.0.1")
    svc.start()
    try:
        client = TaskClient(f"127.0.0.1:{svc.port}", svc.token, {"role": "task", "partition": 0})
        watch = Watch(client, 0, silence_limit=1.0)
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
    from hvd_spark._internal.common.service import JobAborted

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
    ]  # the rank behind first
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


def test_the_rank_behind_is_named_first_even_when_heard_from_last(clock):
    """The order of a stall: the fewest marks (mark_progress calls) first, then the longest silent,
    then the lowest rank. A busy block's ticks (the count moves, the marks do not) keep a rank alive
    without moving it along."""
    from types import SimpleNamespace

    from hvd_spark._internal.driver.supervisor import Supervisor

    svc = DriverService(4, bind="127.0.0.1")
    svc.start()
    addr = f"127.0.0.1:{svc.port}"
    tasks = [TaskClient(addr, svc.token, {"role": "task", "partition": p}) for p in range(4)]
    ranks = [TaskClient(addr, svc.token, {"role": "rank", "rank": r}) for r in range(4)]
    try:
        for r, task in enumerate(tasks):
            task.send({KIND: Kind.RANK, "rank": r})
        _until(lambda: len(svc.progress) == 4)

        def progress(rank, count, marks, where):
            ranks[rank].send({KIND: Kind.PROGRESS, "rank": rank, "count": count, "marks": marks, "where": where})
            _until(lambda: svc.progress[rank][1] == count)

        progress(3, 10, 10, "epoch 1 step 10")
        progress(1, 10, 10, "epoch 1 step 10")  # heard at the same time as rank 3: the lower rank first
        clock.now += 0.25
        progress(2, 10, 10, "epoch 1 step 10")  # the same step, heard from later: after ranks 1 and 3
        clock.now += 0.25
        progress(0, 9, 9, "epoch 1 step 9")  # heard from last, but one step behind: first
        clock.now += 0.5
        assert svc.stalled_ranks(0.1) == [
            (0, 0.5, 9, "epoch 1 step 9"),
            (1, 1.0, 10, "epoch 1 step 10"),
            (3, 1.0, 10, "epoch 1 step 10"),
            (2, 0.75, 10, "epoch 1 step 10"),
        ]
        # Rank 0 uploads in a busy block: its count moves past the others', its marks stay.
        progress(0, 13, 9, "uploading the checkpoint")
        assert svc.stalled_ranks(0.1) == []  # alive
        clock.now += 2.0
        stalled = svc.stalled_ranks(0.1)
        assert [r for r, *_ in stalled] == [0, 1, 3, 2] and stalled[0][2:] == (9, "uploading the checkpoint")
        # The supervisor's problem keeps that order and carries the counts to the report.
        problem = Supervisor(svc, SimpleNamespace(), where="local")._stall(0.1)
        assert problem is not None and problem.ranks == [0, 1, 3, 2]
        assert problem.counts == {0: 9, 1: 10, 2: 10, 3: 10}
        assert problem.stalled_hosts == {r: "127.0.0.1" for r in range(4)}
        assert problem.message.startswith("stalled: no rank made progress for stall_timeout=0.1s, the rank furthest")
        first, *_ = problem.message.split("; ")
        assert first.endswith("rank 0 on host 127.0.0.1: none for 2 s, last at uploading the checkpoint (count 9)")
    finally:
        for c in tasks + ranks:
            c.close()
        svc.stop()


def _stall(ranks, counts):
    from hvd_spark._internal.driver.supervisor import Problem

    return Problem("stalled", ranks, stalled_hosts={r: "h" for r in ranks}, counts=counts)


_USER = (
    "",
    ['File "train.py", line 9 in on_train_batch_end', 'File "keras/trainer.py", line 3 in fit'],
)  # a rank in user code
_WAITING = ("", ['File "horovod/tensorflow/mpi_ops.py", line 1 in allreduce', 'File "x.py", line 5 in f'])


def test_the_counts_alone_name_the_rank_behind_when_the_stacks_do_not_tell():
    from hvd_spark._internal.driver.supervisor import explain_problem

    for stacks in ({}, {0: _USER, 1: _USER}):  # no stacks came back; every rank is in user code
        message, ranks = explain_problem(_stall([0, 1], {0: 4, 1: 3}), stacks)
        assert "\nMost likely stalled: rank(s) [1] (behind the others: progress count 3, the others 4)" in message
        assert ranks == [1, 0]
    message, ranks = explain_problem(_stall([2, 0, 1], {2: 5, 0: 7, 1: 8}), {})
    assert "Most likely stalled: rank(s) [2] (behind the others: progress count 5, the others 7 to 8)" in message
    assert ranks == [2, 0, 1]
    message, ranks = explain_problem(_stall([1, 2, 0], {0: 7, 1: 5, 2: 5}), {})
    assert "Most likely stalled: rank(s) [1, 2] (behind" in message and ranks == [1, 2, 0]
    # Equal counts and no telling stacks: no line, the problem's order.
    message, ranks = explain_problem(_stall([1, 0], {0: 4, 1: 4}), {0: _USER, 1: _USER})
    assert "Most likely" not in message and ranks == [1, 0]
    message, ranks = explain_problem(_stall([1, 0], None), {})
    assert "Most likely" not in message and ranks == [1, 0]
    # A timeout is no stall: no line, whatever it carries.
    timeout = dataclasses.replace(_stall([0, 1], {0: 4, 1: 3}), stalled_hosts=None)
    message, ranks = explain_problem(timeout, {})
    assert "Most likely" not in message and ranks == [0, 1]


def test_the_stacks_weigh_more_than_the_counts_and_both_are_said():
    from hvd_spark._internal.driver.supervisor import explain_problem

    # Agreeing: rank 1 is outside the collective rank 0 waits in, and behind.
    message, ranks = explain_problem(_stall([1, 0], {0: 4, 1: 3}), {0: _WAITING, 1: _USER})
    assert (
        "\nMost likely stalled: rank(s) [1] (outside the Horovod collective the others wait in; behind the "
        "others: progress count 3, the others 4)\n" in message
    )
    assert ranks == [1, 0]
    # Disagreeing: the stacks name rank 1, the counts rank 0; rank 1 first, both said.
    message, ranks = explain_problem(_stall([0, 1], {0: 3, 1: 4}), {0: _WAITING, 1: _USER})
    assert (
        "\nMost likely stalled: rank(s) [1] (outside the Horovod collective the others wait in); the progress "
        "counts put rank(s) [0] behind (progress count 3, the others 4), the stacks weigh more\n" in message
    )
    assert ranks == [1, 0]
    lines = message.split("Where each unfinished rank was:\n")[1].splitlines()
    assert lines[0].startswith("  rank 1: File") and lines[1].startswith("  rank 0: File")  # in the report's order
    # A stopped process is the strongest evidence.
    message, ranks = explain_problem(_stall([0, 1], {0: 3, 1: 4}), {0: _USER, 1: ("stopped", None)})
    assert "Most likely stalled: rank(s) [1] (stopped or silent: no Python stack); the progress counts" in message
    assert ranks == [1, 0]
    # Stacks that name every rank (all stopped) single out none: the counts decide.
    message, ranks = explain_problem(_stall([1, 0], {0: 3, 1: 4}), {0: ("stopped", None), 1: ("stopped", None)})
    assert "Most likely stalled: rank(s) [0] (behind the others: progress count 3, the others 4)" in message
    assert ranks == [0, 1]


def test_a_stall_report_from_counts_alone_names_the_rank_behind_in_the_error():
    """A fit's ranks: the one that sleeps in a callback and the one that waits in the next step's
    collective both show user code (Keras runs the collective inside the traced step)."""
    from hvd_spark._internal.common.outcomes import ABORTED, STATE_PREFIX, RankOutcome
    from hvd_spark._internal.driver.supervisor import JobReport, conclude
    from hvd_spark.errors import RankStalledError

    records = [
        RankOutcome(r, ABORTED, tail=(f"{STATE_PREFIX}sleeping", "Stack (most recent call first):", f"  {frame}"))
        for r, frame in ((0, 'File "keras/trainer.py", line 3 in fit'), (1, 'File "cb.py", line 2 in on_epoch_end'))
    ]
    report = JobReport(problem=_stall([1, 0], {0: 41, 1: 40}))
    with pytest.raises(RankStalledError) as caught:
        conclude(records, report, num_proc=2, description="job", elapsed=1.0)
    assert caught.value.ranks[0] == 1 and caught.value.ranks == [1, 0]
    assert "Most likely stalled: rank(s) [1]" in str(caught.value)


def test_a_task_that_vanishes_before_its_rank_finished_stops_the_job_at_once():
    """Its executor died: Spark may keep the barrier stage open (waiting to run it again on slots that
    are gone), so the supervisor cannot wait for Spark to fail it; it stops the other ranks now."""
    from types import SimpleNamespace

    from hvd_spark._internal.common.outcomes import TASK_LOST
    from hvd_spark._internal.driver.supervisor import Supervisor

    svc = DriverService(2, bind="127.0.0.1")
    svc.start()
    addr = f"127.0.0.1:{svc.port}"
    tasks = [TaskClient(addr, svc.token, {"role": "task", "partition": p}) for p in range(2)]
    aborts: list[str] = []
    try:
        for r, task in enumerate(tasks):
            task.send({KIND: Kind.RANK, "rank": r})
        _until(lambda: len(svc.rank_of_partition) == 2)
        options = SimpleNamespace(heartbeat_timeout=600, start_timeout=600, timeout=None, stall_timeout=None)
        sup = Supervisor(svc, options, where="local", say=lambda *a: None, on_abort=aborts.append)
        sup.step()
        assert sup.aborted_at is None  # both tasks there: nothing to do
        tasks[1].close()
        _until(lambda: 1 in svc.vanished)
        sup.step()
        assert sup.aborted_at is not None and [(o.rank, o.type) for o in sup.lost] == [(1, TASK_LOST)]
        assert aborts and aborts[0].startswith("rank 1 on host")
    finally:
        tasks[0].close()
        svc.stop()
