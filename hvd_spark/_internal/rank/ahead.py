"""Batches prepared ahead of the training loop, on a thread of their own (the torch ranks' reader).

A torch rank's loop would otherwise read each row group and copy each batch into tensors between two
steps; pyarrow's reading and numpy's copies release the GIL, so a thread does them while the step
computes (the role ``tf.data``'s prefetch plays for Keras)."""

import queue
import threading
from collections.abc import Iterator
from typing import Any

_DONE = object()


def read_ahead(items: Iterator, depth: int = 2) -> Iterator:
    """``items``, produced by a thread up to ``depth`` items ahead of the consumer, in their order. An
    exception of the producer is raised in the consumer at its place in the sequence. When the consumer
    stops early (an error, ``break``), the producer stops at its next item. A producer that blocks (a
    store that does not answer) blocks the consumer, which the rank's stall watchdog reports."""
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(entry: tuple[BaseException | None, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, _DONE))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put((e, None))

    thread = threading.Thread(target=produce, name="hvd_spark-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            error, item = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
