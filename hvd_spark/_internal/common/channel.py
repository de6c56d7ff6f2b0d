"""What a job's coordinator tells a Spark Connect client: rank output, progress events, notices.

A Connect client accepts no connection from the cluster, so the coordinator (in the first barrier
task, see ``driver/coordinator.py``) writes what the driver service would have shown, as JSON records:

- with a store: every second, the new records as one file ``<path>/<seq>.jsonl`` (written
  whole, so a reader never sees half a file), which the client polls while the job runs;
- without one: the records are kept (rank output capped per rank) and come back with the job's
  output rows, so the client shows them when the job ends.

Record kinds: ``{"k": "start"}`` (every task connected), ``{"k": "log", "rank", "line"}``,
``{"k": "event", "rank", "payload"}``, ``{"k": "say", "level", "msg"}`` (the coordinator's own
messages), ``{"k": "abort", "reason"}`` (the coordinator told the ranks to stop).
"""

import contextlib
import json
import logging
import posixpath
import threading
from collections.abc import Callable

from hvd_spark._internal.common import settings

logger = logging.getLogger(__name__)
rank_logger = logging.getLogger("hvd_spark.rank")

FLUSH_INTERVAL = settings.CHANNEL_FLUSH_INTERVAL  # seconds between two files of a live channel
MAX_KEPT_LINES = settings.MAX_KEPT_LINES  # rank output lines kept per rank when there is no store to write them to


class ChannelWriter:
    """The coordinator's end. ``store`` and ``path`` (a folder in it) make the channel live."""

    def __init__(self, store=None, path: str | None = None, interval: float = FLUSH_INTERVAL):
        self.store, self.path = store, path
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._kept: list[dict] = []
        self._lines: dict[int, int] = {}
        self._dropped: dict[int, int] = {}
        self._seq = 0
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._thread = threading.Thread(target=self._flusher, args=(interval,), daemon=True, name="hvd_spark-chan")
            self._thread.start()

    def put(self, record: dict) -> None:
        with self._lock:
            if self.store is not None:
                self._pending.append(record)
                return
            if record.get("k") == "log":
                rank = int(record.get("rank", -1))
                self._lines[rank] = self._lines.get(rank, 0) + 1
                if self._lines[rank] > MAX_KEPT_LINES:
                    self._dropped[rank] = self._dropped.get(rank, 0) + 1
                    return
            self._kept.append(record)

    def log(self, rank: int, line: str) -> None:
        self.put({"k": "log", "rank": rank, "line": line})

    def event(self, rank: int, payload: dict) -> None:
        self.put({"k": "event", "rank": rank, "payload": payload})

    def say(self, level: int, message: str) -> None:
        self.put({"k": "say", "level": level, "msg": message})

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        self._seq += 1
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in batch).encode()
        try:
            self.store.files.write_bytes(posixpath.join(str(self.path), f"{self._seq:08d}.jsonl"), data)
        except Exception as e:  # the store hiccuped: keep the records for the next try
            logger.warning("writing the job's progress to %s failed: %s", self.path, e)
            self._seq -= 1
            with self._lock:
                self._pending[:0] = batch

    def _flusher(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._flush()

    def close(self) -> list[dict]:
        """Writes what is left; returns the kept records (empty for a live channel)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(30)
            self._flush()
            return []
        with self._lock:
            kept = list(self._kept)
        for rank, n in sorted(self._dropped.items()):
            kept.append({"k": "say", "level": logging.WARNING, "msg": f"{n} more output lines of rank {rank} dropped"})
        return kept


class ChannelReader:
    """The client's end of a live channel: :meth:`poll` returns the records written since the last call."""

    def __init__(self, store, path: str):
        self.store, self.path = store, path
        self._seen: set[str] = set()

    def poll(self) -> list[dict]:
        out: list[dict] = []
        try:
            names = [n for n in self.store.files.listdir(self.path) if n.endswith(".jsonl") and n not in self._seen]
        except Exception as e:  # the store hiccuped: try again at the next poll
            logger.debug("listing %s failed: %s", self.path, e)
            return out
        for name in sorted(names):
            try:
                data = self.store.files.read_bytes(posixpath.join(self.path, name))
            except Exception as e:
                logger.debug("reading %s failed: %s", name, e)
                break  # keep the order: read it and those after it at the next poll
            self._seen.add(name)
            out += [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        return out

    def remove(self) -> None:
        """Deletes the channel, and its parent folder when no other job's channel is in it."""
        with contextlib.suppress(Exception):  # what is left of a live channel is harmless
            self.store.files.rm(self.path)
            parent = posixpath.dirname(self.path.rstrip("/"))
            if not self.store.files.listdir(parent):
                self.store.files.rm(parent)


def show(
    records: list[dict],
    on_event: Callable[[int, dict], None] | None,
    on_log: Callable[[int, str], None] | None = None,
) -> None:
    """Shows records on the client as the driver service shows them on a classic driver (a rank's
    output line goes to ``on_log(rank, line)`` when given, else to the ``hvd_spark.rank`` logger)."""
    for r in records:
        kind = r.get("k")
        if kind == "log" and on_log is not None:
            on_log(int(r.get("rank", -1)), str(r.get("line", "")))
        elif kind == "log":
            rank_logger.info("[rank %s] %s", r.get("rank"), r.get("line", ""))
        elif kind == "event" and on_event is not None:
            try:
                on_event(int(r.get("rank", -1)), r.get("payload") or {})
            except Exception:  # a progress callback must never break the job
                logger.exception("progress callback failed")
        elif kind == "say":
            logger.log(int(r.get("level", logging.INFO)), "%s", r.get("msg", ""))
