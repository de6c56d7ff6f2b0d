"""A store's file operations, each under the one retry policy of store operations (``common/retry.py``).

A :class:`StoreFiles` is what a :class:`~hvd_spark._internal.data.store.Store` (``store.files``) and
the packages that read or write its files (the data's writers, the ranks, the fit's plan, the
Spark Connect channel) use: fsspec's filesystem for the store's prefix, and operations on paths of
it (as the store's ``*_path`` methods give) whose transient errors (connection refused or reset,
timeouts, 5xx, throttling) are retried for ``retry_window`` seconds. Writes are atomic (a
temporary name beside the file, then a rename). It knows nothing about Spark, nor about what the
files hold. These names are internal: users call the :class:`Store`.
"""

import contextlib
import functools
import hashlib
import json
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from hvd_spark._internal.common import retry

T = TypeVar("T")


class StoreFiles:
    """The files under a store's ``prefix`` (a local path or an fsspec URL), reached with
    ``storage_options``; ``retry_window`` as the store's (None: the setting's).

    Attributes:
        fs: the fsspec filesystem.
        root: the prefix as a path of ``fs`` (without a trailing ``/``).
        protocol: ``fs``'s protocol (``"file"``, ``"s3"``, ...).
    """

    def __init__(self, prefix: str, storage_options: dict[str, Any], retry_window: float | None):
        import fsspec

        self.prefix = prefix
        self.storage_options = storage_options
        self._window = retry_window
        self.fs, root = fsspec.core.url_to_fs(prefix, **storage_options)
        self.root = root.rstrip("/") or "/"
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    @property
    def retry_window(self) -> float:
        """Seconds a failing operation is retried (the store's ``retry_window`` argument, else the setting)."""
        return self._window if self._window is not None else retry.window()

    def retrying(self, operation: str, fn: Callable[[], T]) -> T:
        """``fn()`` under the store's retry policy (``common/retry.py``); ``operation`` says what it
        does, for the error when the store stays unreachable."""
        from hvd_spark._internal.common.secrets import url_without_credentials

        return retry.call(url_without_credentials(self.prefix), operation, fn, seconds=self.retry_window)

    # --- paths ---
    def path(self, *parts: str) -> str:
        """The path of ``parts`` under the store's prefix."""
        return posixpath.join(self.root, *parts)

    def rel(self, path: str) -> str:
        """``path`` relative to the store's prefix, for messages."""
        root = self.root.rstrip("/") + "/"
        return path[len(root) :] if path.startswith(root) else path

    def url(self, path: str) -> str:
        """A URL for ``path`` that Spark and Petastorm understand."""
        return self.fs.unstrip_protocol(path)

    @property
    def is_local(self) -> bool:
        return self.protocol in ("file", "local")

    # --- reading ---
    def fresh(self, path: str) -> None:
        """Forgets fsspec's cached listings of ``path``: object stores' filesystems (s3fs) cache each
        listing for the life of the process, and other processes write here (ranks, other fits)."""
        self.fs.invalidate_cache(path)

    def exists(self, path: str) -> bool:
        def exists() -> bool:
            self.fresh(path)
            return self.fs.exists(path)

        return self.retrying(f"checking {self.rel(path)}", exists)

    def read_bytes(self, path: str) -> bytes:
        def read() -> bytes:
            with self.fs.open(path, "rb") as f:
                return f.read()

        return self.retrying(f"reading {self.rel(path)}", read)

    def read_json(self, path: str) -> Any:
        data = self.read_bytes(path)
        try:
            return json.loads(data.decode())
        except ValueError as e:  # cut short, or not ours: say which file
            raise ValueError(f"{self.url(path)} does not read as JSON: {retry.one_line(e)}") from e

    def listdir(self, path: str) -> list[str]:
        return sorted(self.sizes(path))

    def sizes(self, path: str) -> dict[str, int | None]:
        """The names in the folder ``path`` with their sizes in bytes (None for folders); empty when
        it does not exist."""

        def ls() -> dict[str, int | None]:
            self.fresh(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return {}
            return {
                posixpath.basename(e["name"].rstrip("/")): (e.get("size") if e.get("type") != "directory" else None)
                for e in entries
            }

        return self.retrying(f"listing {self.rel(path)}", ls)

    def mtime(self, path: str) -> float:
        """When ``path`` was last modified (epoch seconds), 0.0 when it does not exist or has no time."""
        try:
            info = self.retrying(f"reading the time of {self.rel(path)}", lambda: self.fs.info(path))
        except FileNotFoundError:
            return 0.0
        for k in ("mtime", "LastModified", "last_modified", "modified", "created"):
            v = info.get(k)
            if v is not None:
                return v.timestamp() if hasattr(v, "timestamp") else float(v)
        return 0.0

    def sha256(self, path: str) -> str:
        """The SHA-256 of the file at ``path`` (one read; the caller retries)."""
        with self.fs.open(path, "rb") as f:
            return sha256_of(f)

    def parquet_metadata(self, path: str):
        """The footer (pyarrow ``FileMetaData``) of the Parquet file at ``path``."""
        import pyarrow.parquet as pq

        def footer():
            self.fresh(path)
            with self.fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata

        return self.retrying(f"reading the footer of {self.rel(path)}", footer)

    # --- writing ---
    def makedirs(self, path: str) -> None:
        self.retrying(f"creating {self.rel(path)}", lambda: self.fs.makedirs(path, exist_ok=True))

    def atomic(self, path: str, write: Callable[[str], Any]) -> None:
        """Runs ``write(tmp)`` for a temporary name beside ``path``, then renames it into place."""
        parent = posixpath.dirname(path)

        def attempt() -> None:
            self.makedirs(parent)
            tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
            try:
                write(tmp)
                self.fs.mv(tmp, path)
            except BaseException:
                with contextlib.suppress(Exception):  # the store is down: the write's own error matters
                    self.fs.rm(tmp)
                raise

        self.retrying(f"writing {self.rel(path)}", attempt)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` atomically: to a temporary name beside it, then a rename."""

        def write(tmp):
            with self.fs.open(tmp, "wb") as f:
                f.write(data)

        self.atomic(path, write)

    def write_json(self, path: str, obj: Any) -> None:
        self.write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())

    def create_exclusive_json(self, path: str, obj: Any) -> bool:
        """Writes ``obj`` to ``path`` only if nothing is there; returns whether this call wrote it.

        On local (and mounted shared) filesystems this is atomic across processes and hosts: the
        file is written under a temporary name and hard-linked into place, and a link fails when
        the name exists. Object stores and other fsspec filesystems have no such operation here,
        so the check and the (atomic) write are two steps: two writers that race within that gap
        both succeed and the later one's file stays. Callers must be correct in that case too.
        """
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        if not self.is_local:
            if self.exists(path):
                return False
            self.write_bytes(path, data)
            return True
        parent = posixpath.dirname(path)
        self.makedirs(parent)
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

    def rm(self, path: str) -> None:
        """Removes the file or folder ``path`` (nothing there: nothing to do)."""

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: nothing left to do
                self.fresh(path)
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)

        self.retrying(f"removing {self.rel(path)}", rm)

    # --- copies from and to local files ---
    def upload_file(self, local: str, path: str) -> None:
        """Copies a local file to ``path`` atomically."""
        self.atomic(path, lambda tmp: self.fs.put_file(local, tmp))

    def copy_file(self, src: str, path: str) -> None:
        """Copies the store's file ``src`` to ``path`` atomically, within the store (on an object store, a
        copy the server makes): no local temporary file."""
        self.atomic(path, lambda tmp: self.fs.copy(src, tmp))

    def download_file(self, path: str, local: str) -> str:
        self.retrying(f"downloading {self.rel(path)}", lambda: self.fs.get_file(path, local))
        return local

    def upload_dir(self, local_dir: str, path: str) -> None:
        """Copies the files under a local folder to ``path`` (for TensorBoard logs)."""
        for dirpath, _, files in os.walk(local_dir):
            rel = os.path.relpath(dirpath, local_dir)
            for name in files:
                dest = posixpath.normpath(posixpath.join(path, rel.replace(os.sep, "/"), name))
                self.makedirs(posixpath.dirname(dest))
                local = os.path.join(dirpath, name)
                self.retrying(f"uploading {self.rel(dest)}", functools.partial(self.fs.put_file, local, dest))

    def local_copy(self, path: str) -> str:
        """Downloads ``path`` to a local temporary file (or returns it, on a local store)."""
        if self.is_local:
            return path
        fd, local = tempfile.mkstemp(suffix=posixpath.basename(path))
        os.close(fd)
        return self.download_file(path, local)

    def check_writable(self) -> None:
        """Raises ValueError, leaving nothing behind, when the store cannot be written."""
        probe = self.path(f".hvd_spark-probe-{uuid.uuid4().hex}")
        try:
            self.fs.exists(self.root)  # one request: a server that is down fails here, before any retries of a write
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
            self.makedirs(self.root)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
        except Exception as e:
            raise ValueError(
                f"store must be writable by hvd_spark. Received: {self.prefix!r}, which failed "
                f"with {type(e).__name__}: {e}. Choose a path every executor can write."
            ) from e
        finally:
            with contextlib.suppress(Exception):  # the probe was never written: nothing to remove
                self.fs.rm(probe)


def sha256_of(f) -> str:
    """The SHA-256 (hex) of what the open binary file ``f`` holds from where it is."""
    h = hashlib.sha256()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()
