"""Predictions in a process forked by the host's warm server, for a UDF worker that has not imported
TensorFlow.

A transform's first task on an executor used to spend 3-4 s importing TensorFlow in each Spark
Python worker before it predicted anything. After a fit, the host's warm server (``task/warm.py``)
has TensorFlow, Keras and hvd_spark imported already: the worker asks it for a child process
(:func:`open_model`), which loads the model and predicts the columns the worker sends it, over a
socket pair that only the two of them hold (the child's loop: ``child.py``, the payload this module
asks the server for). The worker itself never imports TensorFlow.

It is only a faster start: the child has the worker's environment, working folder and ``sys.path``,
loads the model the way the worker would (:func:`~hvd_spark._internal.infer.cache.load_model`) and
predicts with the same code (:func:`~hvd_spark._internal.infer.batching.predict_columns`). When no
server of the application lives on the host with an environment the worker could use, or it cannot
fork, the worker loads the model itself (:func:`open_model` returns None). A child ends when the
worker closes its end (a newer model, the worker's exit: the server kills the child of a connection
that closes) and with its server.

Messages: an 8-byte length, then a pickle; requests ``("load", ...)`` and ``("predict", ...)``,
replies ``("ok", value)`` or ``("error", type name, message, traceback text, the exception pickled
or None)``: an exception that does not rebuild in the worker still reports its type and message.
"""

import logging
import os
import pickle
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from hvd_spark._internal.common import forks
from hvd_spark._internal.infer import batching

logger = logging.getLogger(__name__)

LOAD_TIMEOUT = 600.0  # seconds for the child to load the model (a large one, from S3)
PREDICT_TIMEOUT = 3600.0  # seconds for one batch of predictions
_HEADER = struct.Struct(">Q")
# What this worker asks the warm server for: a child that serves it over the socket it passes.
PAYLOAD = forks.Payload("infer", "hvd_spark._internal.infer.child:serve", fds=1)
INFER_NAME = PAYLOAD.process_name  # a forked inference process's name (/proc/<pid>/comm)


class RemoteGone(ConnectionError):
    """The inference process went away or stopped answering (not an error of the model)."""


def send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def receive(sock: socket.socket) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, n)


class RemoteModel(batching.ColumnPredictor):
    """A model loaded in an inference process (see the module's doc): what a UDF worker predicts with."""

    def __init__(self, sock: socket.socket, conn: socket.socket, pid: int):
        self.sock, self.conn, self.pid = sock, conn, pid
        self.broken = False
        self._lock = threading.Lock()
        # What predicts once this process is gone (killed, or ended with its server): a model
        # loaded anew, in another process or here (set by the worker's cache, ``cache.load_cached``).
        self.reload: Callable[[], Any] | None = None
        self._replacement: Any = None

    def call(self, request: tuple, timeout: float, doing: str):
        """Sends ``request``; its result, or the child's exception (with the child's traceback as a note)."""
        with self._lock:
            if self.broken:
                raise RemoteGone(f"the inference process {self.pid} is gone (an earlier call failed)")
            try:
                self.sock.settimeout(timeout)
                send(self.sock, request)
                raw = receive(self.sock)
            except TimeoutError:
                self.close()
                raise RemoteGone(
                    f"the inference process {self.pid} (forked by the warm server) did not answer within "
                    f"{timeout:.0f} s while {doing}"
                ) from None
            except (OSError, EOFError) as exc:
                status = self._exit_status()
                self.close()
                raise RemoteGone(
                    f"the inference process {self.pid} (forked by the warm server) went away while {doing}"
                    f"{status}: {exc}"
                ) from None
            except BaseException:  # interrupted between request and reply: the stream is out of step
                self.close()
                raise
        try:
            reply = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - a reply this worker cannot read is reported as such
            raise RuntimeError(f"the inference process {self.pid}'s reply could not be read here: {exc!r}") from None
        if reply[0] == "error":
            raise _rebuilt(reply, self.pid)
        return reply[1]

    def _exit_status(self) -> str:
        """How the child ended, as its server reported it (within a second), for the error message."""
        import json
        import select

        try:
            ready, _, _ = select.select([self.conn], [], [], 1.0)
            line = self.conn.recv(4096).split(b"\n", 1)[0] if ready else b""
            rc = int(json.loads(line)["rc"]) if line else None
        except (OSError, ValueError, KeyError, TypeError):
            rc = None
        if rc is None:
            return ""
        from hvd_spark._internal.task.procs import signal_name

        return f" (killed by {signal_name(rc)})" if rc < 0 else f" (exit code {rc})"

    def predict_columns(self, cols, n, inputs, outputs, batch_size, names):
        """:func:`~hvd_spark._internal.infer.batching.predict_columns`, in the child; once the child
        is gone, with the model :attr:`reload` gives (loaded in this worker: a batch that kills its
        process is not tried in another child, and again)."""
        if self._replacement is None:
            request = ("predict", cols, n, inputs, outputs, batch_size, names)
            try:
                return self.call(request, PREDICT_TIMEOUT, "predicting")
            except RemoteGone as exc:
                if self.reload is None:
                    raise
                logger.warning("%s; loading the model in this worker", exc)
                self._replacement = self.reload()
        return batching.predict_columns(self._replacement, cols, n, inputs, outputs, batch_size, names)

    def close(self) -> None:
        """Ends the child (the server kills a child whose connection closed)."""
        self.broken = True
        for s in (self.sock, self.conn):
            try:
                s.close()
            except OSError:
                logger.debug("closing a socket of inference process %d failed", self.pid, exc_info=True)


def open_model(app: str, url: str, storage_options: dict, co_bytes: bytes | None, num_threads: int):
    """The model at ``url`` loaded in a child of this host's warm server for ``app``, or None when
    no server can serve this worker (the caller loads the model itself). An error of the model
    (a missing file, a custom object that does not load) is raised as the child raised it."""
    env = dict(os.environ)
    fp = forks.find_server(env, app)
    if fp is None:
        return None
    mine, theirs = socket.socketpair()
    try:
        conn, pid = forks.fork(
            fp, PAYLOAD, env=env, workdir=os.getcwd(), out_fd=2, fds=[theirs.fileno()], sys_path=sys.path
        )
    except (OSError, ValueError, KeyError) as exc:
        logger.info("the warm server %s could not fork an inference process (%s); loading the model here", fp, exc)
        mine.close()
        return None
    finally:
        theirs.close()
    model = RemoteModel(mine, conn, pid)
    try:
        model.call(("load", url, storage_options, co_bytes, num_threads), LOAD_TIMEOUT, "loading the model")
    except RemoteGone as exc:
        logger.warning("%s; loading the model here", exc)
        return None
    except BaseException:
        model.close()  # the model's own error (a missing file, a custom object): raised as the child raised it
        raise
    return model


def error_reply(exc: BaseException, text: str) -> tuple:
    """An error reply: the exception's type, message and traceback as text, and the exception pickled
    when it pickles (the worker rebuilds it if it can, see :func:`_rebuilt`)."""
    try:
        pickled = pickle.dumps(exc, protocol=5)
    except Exception:  # noqa: BLE001 - its text still reports it
        pickled = None
    return ("error", f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text, pickled)


def _rebuilt(reply: tuple, pid: int) -> BaseException:
    """The child's exception, with its traceback as a note; a RuntimeError naming its type when it
    does not rebuild here."""
    _, kind, message, text, pickled = reply
    error: BaseException | None = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - e.g. a class whose __init__ takes other arguments
            error = None
    if not isinstance(error, BaseException):
        error = RuntimeError(f"{kind.replace('builtins.', '')}: {message}")
    error.add_note(f"(raised in the inference process {pid} forked by the warm server)\n{text}")
    return error
