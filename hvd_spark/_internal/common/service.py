"""A small TCP service that the job's tasks and ranks talk to: on the Spark driver, or on Spark
Connect in the job's first barrier task (``driver/coordinator.py``). The wire protocol of every
process: the service, its client (:class:`TaskClient`, in tasks and ranks) and the message kinds,
so it lives in ``common/``.

Tasks say hello when they start (so the driver knows which ones are running), forward their
rank's output lines, report failure and completion; ranks send progress events. The driver
can tell every task to abort. Messages are JSON objects, one per line; every connection
starts with a hello that carries the job's random token, and connections without it are
dropped.
"""

import contextlib
import functools
import json
import logging
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from enum import StrEnum

logger = logging.getLogger(__name__)
rank_logger = logging.getLogger("hvd_spark.rank")

KIND = "t"  # the field of every message that says its kind


class Kind(StrEnum):
    """Message kinds. Tasks and ranks send the first six to the driver; the driver sends the next two;
    both send heartbeats; tasks exchange what they know of themselves through the next two (an
    all-gather through the driver: Spark's barrier ``allGather`` costs about a second a round);
    ranks report their progress for the stall watchdog and the end of their ``hvd.init()`` (after
    which rank 0's task closes Gloo's rendezvous) with the last three."""

    HELLO = "hello"  # the first message of every connection: {"token", "role", "partition" or "rank"}
    RANK = "rank"  # a task's rank, once assigned: {"rank"}
    LOG = "log"  # one line of a rank's output: {"rank", "line"}
    EVENT = "event"  # a progress event from a rank: {"rank", "payload"}
    FAIL = "fail"  # a rank's failure: the outcome record
    DONE = "done"  # a task finished: {"rank", "ok"}
    ABORT = "abort"  # to every task: stop now: {"reason", "dump"}
    ALL_DONE = "all_done"  # to every task: every rank finished, exit
    BEAT = "beat"  # a heartbeat, every settings.HEARTBEAT_INTERVAL seconds each way: {}
    GATHER = "gather"  # a task's contribution to an all-gather: {"round", "info"}
    GATHERED = "gathered"  # to every task once all have contributed: {"round", "infos"} (partition order)
    PROGRESS = "progress"  # a rank's progress, when its count moved: {"rank", "count", "marks", "where"}
    INITIALIZED = "initialized"  # a rank's hvd.init() returned: {"rank"}
    RANKS_INITIALIZED = "ranks_initialized"  # to every task: every rank's hvd.init() returned


class JobAborted(Exception):
    """The driver aborted the job while a task waited on it."""


def send_line(sock: socket.socket, message: dict, lock: "threading.Lock | None" = None) -> None:
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    if lock is None:
        sock.sendall(data)
    else:
        with lock:
            sock.sendall(data)


def read_lines(sock: socket.socket):
    """Yields the JSON messages on ``sock`` until it closes."""
    buf = sock.makefile("rb")
    for raw in buf:
        raw = raw.strip()
        if raw:
            try:
                yield json.loads(raw)
            except ValueError:
                return


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        service: DriverService = self.server.service  # type: ignore[attr-defined]
        sock = self.request
        sock.settimeout(30)
        lines = read_lines(sock)
        try:
            hello = next(lines)
        except (StopIteration, OSError):
            return
        if not isinstance(hello, dict) or not secrets.compare_digest(str(hello.get("token", "")), service.token):
            return
        sock.settimeout(None)
        role = hello.get("role")
        conn = _Conn(sock, hello)
        if role == "task":
            service._task_connected(conn)
        elif role == "rank":
            service._rank_connection(conn, True)
        try:
            for msg in lines:
                service._dispatch(conn, msg)
        except OSError:
            logger.debug("connection from partition %s closed", conn.partition)
        finally:
            if role == "task":
                service._task_disconnected(conn)
            elif role == "rank":
                service._rank_connection(conn, False)


class _Conn:
    def __init__(self, sock, hello):
        self.sock = sock
        self.hello = hello
        self.lock = threading.Lock()
        self.partition = hello.get("partition")
        self.rank = hello.get("rank")

    def send(self, message: dict) -> bool:
        try:
            send_line(self.sock, message, self.lock)
            return True
        except OSError:
            return False


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class DriverService:
    """The driver's end of a job. Start with :meth:`start`, stop with :meth:`stop`.

    Args:
        num_proc: number of tasks (and ranks) in the job.
        on_event: called as ``on_event(rank, payload)`` for each progress event a rank sends.
        on_log: called as ``on_log(rank, line)`` for each output line of a rank (default: the
            ``hvd_spark.rank`` logger).
        bind: address to listen on ('' for every interface).
    """

    def __init__(
        self,
        num_proc: int,
        *,
        on_event: Callable[[int, dict], None] | None = None,
        on_log: Callable[[int, str], None] | None = None,
        bind: str = "",
    ):
        self.num_proc = num_proc
        self._on_log = on_log
        self.token = secrets.token_hex(16)
        self._on_event = on_event
        self._bind = bind
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self.tasks: dict[int, _Conn] = {}  # partition -> connection
        self.rank_of_partition: dict[int, int] = {}
        self.started: dict[int, float] = {}  # partition -> time of hello
        self.done: dict[int, dict] = {}  # rank -> done message
        self.host_of: dict[int, str] = {}  # partition -> the address its task connected from
        self.last_heard: dict[int, float] = {}  # partition -> monotonic time of its task's last message
        self.vanished: dict[int, float] = {}  # partition -> when its connection closed before its rank was done
        self.failures: list[dict] = []  # in the order they reached the driver
        self._gathers: dict[str, dict[int, tuple]] = {}  # round -> partition -> (conn, info)
        # rank -> (monotonic time its count last moved, count, where, marks): from its task's rank message
        # on. The count moves on every tick (alive); marks only on mark_progress (steps done).
        self.progress: dict[int, tuple[float, int, str, int]] = {}
        self.initialized: set[int] = set()  # ranks whose hvd.init() returned
        self.rank_conns: dict[int, int] = {}  # rank -> its process's open connections (closed when it exits)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("The driver service has not been started.")
        return self._server.server_address[1]

    def start(self) -> int:
        self._server = _Server((self._bind, 0), _Handler)
        self._server.service = self  # type: ignore[attr-defined]
        # A short poll: stop() (at the end of every job) waits for serve_forever to notice it.
        serve = functools.partial(self._server.serve_forever, poll_interval=0.05)
        self._thread = threading.Thread(target=serve, name="hvd_spark-driver-service", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                for conn in self.tasks.values():
                    with contextlib.suppress(OSError):  # already closed by the task
                        conn.sock.close()
            self._server = None

    # --- called from handler threads ---
    def _task_connected(self, conn: _Conn) -> None:
        with self._lock:
            self.tasks[conn.partition] = conn
            self.started[conn.partition] = time.time()
            self.last_heard[conn.partition] = time.monotonic()
            with contextlib.suppress(OSError):  # closed meanwhile: the host stays unknown
                self.host_of[conn.partition] = conn.sock.getpeername()[0]
            self._lock.notify_all()

    def _rank_connection(self, conn: _Conn, opened: bool) -> None:
        with self._lock:
            rank = int(conn.rank if conn.rank is not None else -1)
            self.rank_conns[rank] = self.rank_conns.get(rank, 0) + (1 if opened else -1)
            if self.rank_conns[rank] <= 0:
                del self.rank_conns[rank]
            self._lock.notify_all()

    def wait_until_stopped(self, timeout: float, silent_after: float | None = None) -> list[str]:
        """Waits until every task's and every rank process's connection has closed (their processes
        exited), at most ``timeout`` seconds; returns what is still connected ("rank 0", "task 1").
        Tasks not heard from for ``silent_after`` seconds (gone with their host), and their ranks, are
        not waited for."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                now = time.monotonic()
                gone = {
                    p
                    for p in self.tasks
                    if silent_after is not None and now - self.last_heard.get(p, now) > silent_after
                }
                gone_ranks = {self.rank_of_partition.get(p) for p in gone}
                alive = [f"rank {r}" for r in sorted(self.rank_conns) if r not in gone_ranks]
                alive += [f"task {p}" for p in sorted(self.tasks) if p not in gone]
                left = deadline - time.monotonic()
                if not alive or left <= 0:
                    return alive
                self._lock.wait(min(left, 0.2))

    def _task_disconnected(self, conn: _Conn) -> None:
        with self._lock:
            if self.tasks.get(conn.partition) is conn:
                del self.tasks[conn.partition]
            for got in self._gathers.values():
                if got.get(conn.partition, (None,))[0] is conn:
                    del got[conn.partition]
            rank = self.rank_of_partition.get(conn.partition)
            if rank is None or rank not in self.done:
                # Gone before its rank finished: the task's process (its executor, its host) died.
                self.vanished.setdefault(conn.partition, time.time())
            self._lock.notify_all()

    def _dispatch(self, conn: _Conn, msg: dict) -> None:
        kind = msg.get(KIND)
        if conn.hello.get("role") == "task":
            self.last_heard[conn.partition] = time.monotonic()
        if kind == Kind.BEAT:
            return
        if kind == Kind.LOG:
            if self._on_log is not None:
                self._on_log(int(msg.get("rank", -1)), str(msg.get("line", "")))
            if msg.get("level") == "warning":  # the task's own word about its rank (a warm server not ready)
                rank_logger.warning("[rank %s] %s", msg.get("rank"), msg.get("line", ""))
            elif self._on_log is None:
                rank_logger.info("[rank %s] %s", msg.get("rank"), msg.get("line", ""))
        elif kind == Kind.RANK:
            with self._lock:
                self.rank_of_partition[conn.partition] = msg["rank"]
                conn.rank = msg["rank"]
                self.progress.setdefault(int(msg["rank"]), (time.monotonic(), 0, "starting", 0))
                self._lock.notify_all()
        elif kind == Kind.EVENT:
            if self._on_event is not None:
                try:
                    self._on_event(int(msg.get("rank", -1)), msg.get("payload") or {})
                except Exception:  # a progress callback must never break the job
                    logger.exception("progress callback failed")
        elif kind == Kind.FAIL:
            with self._lock:
                msg["received"] = time.time()
                self.failures.append(msg)
                self._lock.notify_all()
        elif kind == Kind.DONE:
            with self._lock:
                self.done[int(msg["rank"])] = msg
                self._lock.notify_all()
        elif kind == Kind.GATHER:
            self._gather(conn, msg)
        elif kind == Kind.INITIALIZED:
            with self._lock:
                before = len(self.initialized)
                self.initialized.add(int(msg.get("rank", -1)))
                everyone = len(self.initialized) == self.num_proc > before
            if everyone:
                self.broadcast({KIND: Kind.RANKS_INITIALIZED})
        elif kind == Kind.PROGRESS:
            rank, count = int(msg.get("rank", -1)), int(msg.get("count", 0))
            marks = int(msg.get("marks", count))
            with self._lock:
                if count != self.progress.get(rank, (0.0, -1, "", 0))[1]:
                    self.progress[rank] = (time.monotonic(), count, str(msg.get("where") or ""), marks)

    def _gather(self, conn: _Conn, msg: dict) -> None:
        """Collects one contribution per partition of a round; the last one sends them all out. A
        task whose connection closes takes its contribution back (see ``_task_disconnected``), so
        the tasks of a retried stage never meet a dead task's."""
        key = str(msg.get("round", ""))
        with self._lock:
            got = self._gathers.setdefault(key, {})
            got[conn.partition] = (conn, msg.get("info"))
            if len(got) < self.num_proc:
                return
            del self._gathers[key]
        infos = [got[p][1] for p in sorted(got)]
        reply = {KIND: Kind.GATHERED, "round": key, "infos": infos}
        for p in sorted(got):
            got[p][0].send(reply)

    # --- called from the driver's main thread ---
    def wait(self, timeout: float) -> None:
        with self._lock:
            self._lock.wait(timeout)

    def wake(self) -> None:
        """Ends a :meth:`wait` now (the barrier stage returned)."""
        with self._lock:
            self._lock.notify_all()

    def broadcast(self, message: dict, partitions=None) -> None:
        with self._lock:
            conns = [c for p, c in self.tasks.items() if partitions is None or p in partitions]
        for conn in conns:
            conn.send(message)

    def silent_tasks(self, timeout: float) -> list[tuple[int, int | None, str, float]]:
        """Tasks still connected, whose rank has not finished, that sent nothing for ``timeout``
        seconds: ``(partition, rank, host, seconds)`` each. Tasks send a heartbeat every
        ``settings.HEARTBEAT_INTERVAL`` seconds, so silence means their host stopped answering."""
        now = time.monotonic()
        with self._lock:
            out = []
            for partition in self.tasks:
                rank = self.rank_of_partition.get(partition)
                quiet = now - self.last_heard.get(partition, now)
                if quiet > timeout and (rank is None or rank not in self.done):
                    out.append((partition, rank, self.host_of.get(partition, "?"), quiet))
            return out

    def stalled_ranks(self, timeout: float) -> list[tuple[int, float, int, str]]:
        """The unfinished ranks, when none of them moved its progress count for ``timeout`` seconds
        (counted from its task's rank message), else []: ``(rank, seconds, marks, where)`` each.

        One rank that hangs stops the others at their next collective; a rank that is slow but
        moving (rank 0 uploading a checkpoint in a ``busy`` block) keeps the job alive. The order
        names the rank that is behind first: the fewest marks (its ``mark_progress`` calls: the
        steps it finished), then the longest silent, then the lowest rank. Silence alone does not
        tell: the ranks report once a second, so a rank that sleeps and one that waits for it in
        the next collective fell silent within about a second of each other."""
        now = time.monotonic()
        with self._lock:
            out = [
                (rank, now - moved, marks, where)
                for rank, (moved, _count, where, marks) in self.progress.items()
                if rank not in self.done
            ]
        if not out or any(quiet <= timeout for _, quiet, _, _ in out):
            return []
        return sorted(out, key=lambda r: (r[2], -r[1], r[0]))

    def snapshot(self):
        with self._lock:
            return (
                dict(self.started),
                dict(self.rank_of_partition),
                dict(self.done),
                list(self.failures),
                set(self.tasks),
            )


class TaskClient:
    """A task's (or a rank's) connection to the driver service."""

    def __init__(self, addr: str, token: str, hello: dict, timeout: float = 30.0):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(None)
        self._lock = threading.Lock()
        self._messages = None
        self.send({**hello, KIND: Kind.HELLO, "token": token})

    @property
    def local_ip(self) -> str:
        """The address of this end of the connection: the interface that reaches the driver."""
        return self.sock.getsockname()[0]

    def send(self, message: dict) -> bool:
        try:
            send_line(self.sock, message, self._lock)
            return True
        except OSError:
            return False

    def messages(self):
        """The driver's messages, one iterator per connection (a later caller goes on from where
        an earlier one stopped)."""
        if self._messages is None:
            self._messages = self._read()
        return self._messages

    def _read(self):
        try:
            yield from read_lines(self.sock)
        except OSError:
            return

    def gather(self, round_name: str, info, silence_limit: float = 30.0) -> list:
        """Every task's ``info`` for this round, in partition order, once all have sent theirs. Raises
        ``JobAborted`` if the driver aborts the job meanwhile (it does when tasks fail to start in
        time), ``ConnectionError`` if it goes away or says nothing (not even its heartbeat, every
        few seconds) for ``silence_limit`` seconds."""
        self.send({KIND: Kind.GATHER, "round": round_name, "info": info})
        self.sock.settimeout(silence_limit)
        try:
            for msg in self.messages():
                kind = msg.get(KIND)
                if kind == Kind.GATHERED and msg.get("round") == round_name:
                    return list(msg.get("infos") or [])
                if kind == Kind.ABORT:
                    raise JobAborted(str(msg.get("reason", "")))
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)
        raise ConnectionError(
            f"the driver went away or was silent for {silence_limit:g} s while this task waited for the "
            f"other tasks ({round_name})"
        )

    def close(self) -> None:
        # shutdown first: close() alone leaves the connection open while a reader thread holds a
        # makefile() of it, and the other end would not learn that this task is done.
        with contextlib.suppress(OSError):  # already closed by the driver
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
