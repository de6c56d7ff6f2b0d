"""The inference child: a process forked by the host's warm server (``task/warm.py``) for one
transform's UDF worker, which asked for it with ``remote.py``'s payload. It loads the model and
predicts the columns the worker sends over the socket pair the two of them hold, with the code the
worker would run itself (:func:`~hvd_spark._internal.infer.cache.load_model`,
:func:`~hvd_spark._internal.infer.batching.predict_columns`); messages as ``remote.py`` describes.
"""

import pickle
import socket
import traceback

from hvd_spark._internal.infer import batching, cache
from hvd_spark._internal.infer.remote import error_reply, receive, send


def serve(fd: int) -> int:
    """The inference child's loop over the socket ``fd``, until the worker closes it. Returns the exit code."""
    sock = socket.socket(fileno=fd)
    model = None
    while True:
        try:
            raw = receive(sock)
        except (EOFError, OSError):
            return 0  # the worker closed its end: nothing more to predict
        try:
            request = pickle.loads(raw)
            if request[0] == "load":
                model = cache.load_model(*request[1:])
                reply: tuple = ("ok", None)
            elif request[0] == "predict":
                if model is None:
                    raise RuntimeError("predict before load")
                reply = ("ok", batching.predict_columns(model, *request[1:]))
            else:
                raise ValueError(f"unknown request {request[0]!r}")
        except Exception as exc:  # noqa: BLE001 - the worker raises it, as if it had run here
            reply = error_reply(exc, traceback.format_exc())
        try:
            try:
                send(sock, reply)
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 - a reply that does not pickle is reported as an error
                if reply[0] == "error":
                    send(sock, reply[:4] + (None,))
                else:
                    send(sock, error_reply(RuntimeError(f"the predictions did not pickle: {exc!r}"), ""))
        except OSError:
            return 0
