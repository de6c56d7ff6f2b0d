"""Shared storage for materialized data, checkpoints, logs and models.

A :class:`Store` is a prefix on a filesystem that every executor and the driver can reach:
a local path (one machine, or a shared mount), ``file://``, ``hdfs://``, ``s3://`` ... through
fsspec. It knows nothing about Spark.

Layout under the prefix::

    data/<dataset-key>/<attempt>/{train,val}/   Parquet files of one write (see data.py), _complete when done
    data/<dataset-key>/_hvd_spark_meta.json     names the published attempt and its files
    data/<dataset-key>/_writing-<attempt>.json  the lease of a write in progress
    runs/<run_id>/run.json             what the run trains (model fingerprint, columns)
    runs/<run_id>/checkpoints/         epoch-NNNN.keras + epoch-NNNN.json (the JSON marks it complete)
    runs/<run_id>/logs/                TensorBoard event files
    runs/<run_id>/model.keras          the final model
    runs/<run_id>/_writer.json         the lease of the fit training the run (one at a time)
    runs/<run_id>/_live/<job>/         a training job's progress for a Spark Connect client, while it runs
"""

import contextlib
import json
import logging
import os
import posixpath
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("hvd_spark")

_CKPT = re.compile(r"^epoch-(\d{4,})\.json$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_WRITERS = ("auto", "spark", "store")
_SPARK_PROTOCOLS = ("file", "local", "hdfs", "viewfs")  # filesystems every Spark cluster's Hadoop serves


_HELD_TOKENS: set[str] = set()  # the tokens of the exclusive leases this process holds right now


def _left_lease(path: str, error: BaseException) -> None:
    logger.warning(
        "could not remove the lease %s (%s: %s); it expires once its heartbeat is old enough",
        path,
        type(error).__name__,
        error,
    )


class LeaseHeldError(Exception):
    """The lease at ``path`` is held by a live process, described by ``holder`` (its lease file)."""

    def __init__(self, path: str, holder: dict[str, Any]):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {holder.get('host', '?')} (pid {holder.get('pid', '?')})")


@dataclass(frozen=True, order=True)
class Checkpoint:
    """A complete checkpoint: the model after ``epoch`` epochs and its metadata (history, ...)."""

    epoch: int
    model_path: str
    meta_path: str


class Store:
    """A location on shared storage.

    Args:
        prefix: a local path or a URL (``file://``, ``hdfs://``, ``s3://``, ...).
        storage_options: keyword arguments for the fsspec filesystem (e.g. an S3 endpoint and
            keys: ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3fs``). The driver,
            the Spark tasks that write the data and the ranks all use them.
        parquet_writer: who writes the materialized Parquet: ``"spark"`` (Spark's own writer,
            through the cluster's Hadoop filesystems), ``"store"`` (each Spark task writes its
            partition through this store's fsspec filesystem and storage options, so Spark needs
            no filesystem or credentials for it) or ``"auto"`` (the default: ``"spark"`` for local
            paths and ``hdfs://``, ``"store"`` for every other URL, such as ``s3://``).

    Example:
        >>> store = Store("/tmp/hvd_spark_store")   # doctest: +SKIP
        >>> est = HorovodEstimator(store=store, ...)  # doctest: +SKIP
        >>> s3 = Store("s3://bucket/prefix", storage_options={"endpoint_url": "http://minio:9000"})  # doctest: +SKIP
    """

    def __init__(self, prefix: str, *, storage_options: dict[str, Any] | None = None, parquet_writer: str = "auto"):
        if not isinstance(prefix, str) or not prefix.strip():
            raise ValueError(f"store must be a non-empty path or URL. Received: {prefix!r}.")
        if parquet_writer not in _WRITERS:
            raise ValueError(f"parquet_writer must be one of {list(_WRITERS)}. Received: {parquet_writer!r}.")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict. Received: {type(storage_options).__name__}.")
        import fsspec

        self.parquet_writer = parquet_writer
        self.storage_options = dict(storage_options or {})
        if "://" not in prefix:
            prefix = os.path.abspath(os.path.expanduser(prefix))
        self._fs, self._root = fsspec.core.url_to_fs(prefix, **self.storage_options)
        self._root = self._root.rstrip("/") or "/"
        self._protocol = self._fs.protocol if isinstance(self._fs.protocol, str) else self._fs.protocol[0]
        self.prefix = prefix

    @property
    def spark_writes(self) -> bool:
        """Whether Spark's own Parquet writer writes the materialized data (see ``parquet_writer``)."""
        if self.parquet_writer == "auto":
            return self._protocol in _SPARK_PROTOCOLS
        return self.parquet_writer == "spark"

    @classmethod
    def create(cls, store) -> "Store":
        """A Store from a Store, a path or a URL."""
        if isinstance(store, Store):
            return store
        if isinstance(store, (str, os.PathLike)):
            return cls(os.fspath(store))
        raise TypeError(f"store must be a path, a URL or a hvd_spark.Store. Received: {type(store).__name__}.")

    def __repr__(self) -> str:
        return f"Store({self.prefix!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Store) and other.to_config() == self.to_config()

    def __hash__(self) -> int:
        return hash(self.prefix)

    # --- plain-data form, for workers and persistence ---
    def to_config(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "storage_options": self.storage_options, "parquet_writer": self.parquet_writer}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Store":
        return cls(
            config["prefix"],
            storage_options=config.get("storage_options"),
            parquet_writer=config.get("parquet_writer", "auto"),
        )

    # --- paths ---
    def _path(self, *parts: str) -> str:
        return posixpath.join(self._root, *parts)

    def _url(self, path: str) -> str:
        """A URL for ``path`` that Spark and Petastorm understand."""
        return self._fs.unstrip_protocol(path)

    def _data_path(self, key: str) -> str:
        return self._path("data", key)

    def run_path(self, run_id: str) -> str:
        validate_run_id(run_id)
        return self._path("runs", run_id)

    def checkpoints_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "checkpoints")

    def logs_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "logs")

    def model_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "model.keras")

    # --- file operations ---
    def _fresh(self, path: str) -> None:
        """Forgets fsspec's cached listings of ``path``: object stores' filesystems (s3fs) cache each
        listing for the life of the process, and other processes write here (ranks, other fits)."""
        self._fs.invalidate_cache(path)

    def _exists(self, path: str) -> bool:
        self._fresh(path)
        return self._fs.exists(path)

    def _makedirs(self, path: str) -> None:
        self._fs.makedirs(path, exist_ok=True)

    def _read_bytes(self, path: str) -> bytes:
        with self._fs.open(path, "rb") as f:
            return f.read()

    def _read_json(self, path: str) -> Any:
        return json.loads(self._read_bytes(path).decode())

    def _atomic(self, path: str, write) -> None:
        """Runs ``write(tmp)`` for a temporary name beside ``path``, then renames it into place."""
        parent = posixpath.dirname(path)
        self._makedirs(parent)
        tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
        try:
            write(tmp)
            self._fs.mv(tmp, path)
        except BaseException:
            self._rm(tmp)
            raise

    def _write_bytes(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` atomically: to a temporary name beside it, then a rename."""

        def write(tmp):
            with self._fs.open(tmp, "wb") as f:
                f.write(data)

        self._atomic(path, write)

    def _write_json(self, path: str, obj: Any) -> None:
        self._write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())

    def _create_exclusive_json(self, path: str, obj: Any) -> bool:
        """Writes ``obj`` to ``path`` only if nothing is there; returns whether this call wrote it.

        On local (and mounted shared) filesystems this is atomic across processes and hosts: the
        file is written under a temporary name and hard-linked into place, and a link fails when
        the name exists. Object stores and other fsspec filesystems have no such operation here,
        so the check and the (atomic) write are two steps: two writers that race within that gap
        both succeed and the later one's file stays. Callers must be correct in that case too.
        """
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        if not self._is_local:
            if self._exists(path):
                return False
            self._write_bytes(path, data)
            return True
        parent = posixpath.dirname(path)
        self._makedirs(parent)
        tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    @property
    def _is_local(self) -> bool:
        return self._protocol in ("file", "local")

    @contextlib.contextmanager
    def _lease(self, path: str, heartbeat: float, **info):
        """Holds a lease file at ``path`` while the block runs: a JSON with ``info``, this host and
        process, refreshed every ``heartbeat`` seconds by a daemon thread, removed at the end.

        Others read it with :meth:`live_leases` to tell a writer in progress from one that died
        (whose heartbeat stops).
        """
        doc = dict(info, host=socket.gethostname(), pid=os.getpid(), started=time.time())

        def beat() -> bool:
            with contextlib.suppress(Exception):  # a missed heartbeat is retried at the next one
                self._write_json(path, dict(doc, heartbeat=time.time()))
            return True

        beat()
        try:
            with self._beating(path, heartbeat, beat):
                yield
        finally:
            try:
                self._rm(path)
            except Exception as e:  # the store is unreachable: the block's own outcome matters more
                _left_lease(path, e)

    @contextlib.contextmanager
    def _beating(self, path: str, heartbeat: float, beat: Callable[[], bool]):
        """Calls ``beat()`` every ``heartbeat`` seconds from a daemon thread while the block runs, until
        it returns False (the lease at ``path`` was lost)."""
        stop = threading.Event()

        def run():
            while not stop.wait(heartbeat):
                if not beat():
                    return

        thread = threading.Thread(target=run, name=f"hvd_spark-lease-{posixpath.basename(path)}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=heartbeat + 5)

    @contextlib.contextmanager
    def _exclusive_lease(self, path: str, heartbeat: float, stale: float, **info):
        """Holds the only lease at ``path`` while the block runs, or raises :class:`LeaseHeldError`
        with the holder's lease when another process holds it (its heartbeat younger than ``stale``
        seconds). A lease whose holder stopped beating (its process or host died) is taken over.

        The lease carries a random token; the heartbeat thread rewrites it only while it still holds
        that token, and the end removes it only then, so a holder that lost its lease (it was taken
        over after a long stall) never removes its successor's.
        """
        token = uuid.uuid4().hex
        doc = dict(info, host=socket.gethostname(), pid=os.getpid(), started=time.time(), token=token)

        def current() -> dict[str, Any] | None:
            try:
                return self._read_json(path)
            except (FileNotFoundError, ValueError):  # released meanwhile / being replaced
                return None

        if not self._create_exclusive_json(path, dict(doc, heartbeat=time.time())):
            held = current()
            # This process's own lease that it could not remove (the store was down then) is not held.
            ours_left = held is not None and (held.get("host"), held.get("pid")) == (doc["host"], doc["pid"])
            if (
                held is not None
                and time.time() - float(held.get("heartbeat", 0)) < stale
                and not (ours_left and held.get("token") not in _HELD_TOKENS)
            ):
                raise LeaseHeldError(path, held)
            self._write_json(path, dict(doc, heartbeat=time.time()))  # stale: its holder is gone
            time.sleep(0.2)
            mine = current()
            if mine is None or mine.get("token") != token:  # another process took it over at the same time
                raise LeaseHeldError(path, mine or {})

        def beat() -> bool:
            try:
                held = current()
            except Exception:  # the store is unreachable for now: try again at the next heartbeat
                return True
            if held is not None and held.get("token") != token:
                return False  # taken over: this holder stalled for longer than ``stale``
            with contextlib.suppress(Exception):  # a missed heartbeat is retried at the next one
                self._write_json(path, dict(doc, heartbeat=time.time()))
            return True

        _HELD_TOKENS.add(token)
        try:
            with self._beating(path, heartbeat, beat):
                yield
        finally:
            _HELD_TOKENS.discard(token)
            try:
                held = current()
                if held is not None and held.get("token") == token:
                    self._rm(path)
            except Exception as e:  # the store is unreachable: the block's own outcome matters more
                _left_lease(path, e)

    def _live_leases(self, folder: str, prefix: str, stale: float) -> list[dict[str, Any]]:
        """The leases ``folder/<prefix>*.json`` whose heartbeat is younger than ``stale`` seconds."""
        out = []
        for name in self._listdir(folder):
            if not (name.startswith(prefix) and name.endswith(".json")):
                continue
            with contextlib.suppress(FileNotFoundError, ValueError):  # released meanwhile / being replaced
                doc = self._read_json(posixpath.join(folder, name))
                if time.time() - float(doc.get("heartbeat", 0)) < stale:
                    out.append(dict(doc, name=name))
        return out

    def _upload_file(self, local: str, path: str) -> None:
        """Copies a local file to ``path`` atomically."""
        self._atomic(path, lambda tmp: self._fs.put_file(local, tmp))

    def _download_file(self, path: str, local: str) -> str:
        self._fs.get_file(path, local)
        return local

    def _upload_dir(self, local_dir: str, path: str) -> None:
        """Copies the files under a local folder to ``path`` (for TensorBoard logs)."""
        for dirpath, _, files in os.walk(local_dir):
            rel = os.path.relpath(dirpath, local_dir)
            for name in files:
                dest = posixpath.normpath(posixpath.join(path, rel.replace(os.sep, "/"), name))
                self._makedirs(posixpath.dirname(dest))
                self._fs.put_file(os.path.join(dirpath, name), dest)

    def _rm(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile: nothing left to do
            if self._exists(path):
                self._fs.rm(path, recursive=True)

    def _listdir(self, path: str) -> list[str]:
        self._fresh(path)
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self._fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def _check_writable(self) -> None:
        """Raises ValueError, leaving nothing behind, when the store cannot be written."""
        probe = self._path(f".hvd_spark-probe-{uuid.uuid4().hex}")
        try:
            self._fs.exists(self._root)  # one request: a server that is down fails here, before any retries of a write
        except Exception as e:
            endpoint = self.storage_options.get("endpoint_url") or self.storage_options.get("client_kwargs", {}).get(
                "endpoint_url"
            )
            raise ValueError(
                f"store must be reachable by hvd_spark. Received: {self.prefix!r}"
                + (f" (endpoint_url={endpoint!r})" if endpoint else "")
                + f", which failed with {type(e).__name__}: {e}. Check that its server is up and that "
                "storage_options (endpoint, keys) are right."
            ) from e
        try:
            self._makedirs(self._root)
            with self._fs.open(probe, "wb") as f:
                f.write(b"ok")
        except Exception as e:
            raise ValueError(
                f"store must be writable by hvd_spark. Received: {self.prefix!r}, which failed "
                f"with {type(e).__name__}: {e}. Choose a path every executor can write."
            ) from e
        finally:
            with contextlib.suppress(Exception):  # the probe was never written: nothing to remove
                self._fs.rm(probe)

    # --- checkpoints ---
    def checkpoints(self, run_id: str) -> list[Checkpoint]:
        """Complete checkpoints of a run, oldest first."""
        ckpt_dir = self.checkpoints_path(run_id)
        names = set(self._listdir(ckpt_dir))
        out = []
        for name in names:
            m = _CKPT.match(name)
            if m and f"epoch-{m.group(1)}.keras" in names:
                model = posixpath.join(ckpt_dir, f"epoch-{m.group(1)}.keras")
                out.append(Checkpoint(int(m.group(1)), model, posixpath.join(ckpt_dir, name)))
        return sorted(out)

    def latest_checkpoint(self, run_id: str) -> Checkpoint | None:
        ckpts = self.checkpoints(run_id)
        return ckpts[-1] if ckpts else None

    def _local_copy(self, path: str) -> str:
        """Downloads ``path`` to a local temporary file (or returns it, on a local store)."""
        if self._is_local:
            return path
        fd, local = tempfile.mkstemp(suffix=posixpath.basename(path))
        os.close(fd)
        return self._download_file(path, local)


def checkpoint_names(epoch: int) -> tuple[str, str]:
    return f"epoch-{epoch:04d}.keras", f"epoch-{epoch:04d}.json"


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            "run_id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit. "
            f"Received: {run_id!r}."
        )
    return run_id
