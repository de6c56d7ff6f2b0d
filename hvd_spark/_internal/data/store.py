"""Shared storage for materialized data, checkpoints, logs and models.

A :class:`Store` is a prefix on a filesystem that every executor and the driver can reach:
a local path (one machine, or a shared mount), ``file://``, ``hdfs://``, ``s3://`` ... through
fsspec. It knows nothing about Spark.

Layout under the prefix::

    data/<dataset-key>/<attempt>/{train,val}/   Parquet files of one write (see materialize.py), _complete when done
    data/<dataset-key>/_hvd_spark_meta.json     names the published attempt and its files
    data/<dataset-key>/_writing-<attempt>.json  the lease of a write in progress
    data/<dataset-key>/_reading-<fit>.json     the lease of a fit training on it
    data/<dataset-key>/_last_used.json         when a fit last reused it (and "released": its reading lease ended)
    runs/<run_id>/run.json             what the run trains (model fingerprint, columns, its data record)
    runs/<run_id>/checkpoints/         epoch-NNNN.keras (torch: .pt) + epoch-NNNN.json (the JSON marks it complete and
                                       holds the model file's size and SHA-256)
    runs/<run_id>/checkpoints/damaged/ checkpoints found damaged, set aside by the fit that resumed past them
    runs/<run_id>/logs/                TensorBoard event files
    runs/<run_id>/models/<fit_id>.keras the final model of each fit (never rewritten)
    runs/<run_id>/_writer.json         the lease of the fit training the run (one at a time)
    runs/<run_id>/_live/<job>/         a training job's progress for a Spark Connect client, while it runs

Every file operation of the store goes through one retry policy (``common/retry.py``): transient errors
(connection refused or reset, timeouts, 5xx, throttling) are retried for ``retry_window`` seconds.

This module is the store's public face (paths, checkpoints, models, runs, cleanup). Its file operations
are ``data/files.py``'s :class:`~hvd_spark._internal.data.files.StoreFiles` (``store.files``), its leases
``data/leases.py``; the other packages use those, and this module's functions (:func:`job_config`,
:func:`data_path`, :func:`epoch_checkpoints`, :func:`checkpoint_damage`, :func:`remove_commits_before`,
:func:`release_data`, :func:`prune_checkpoints`),
never the store's underscore names.
"""

import contextlib
import functools
import logging
import os
import posixpath
import re
import time
from dataclasses import dataclass
from typing import Any

from hvd_spark._internal.common import retry
from hvd_spark._internal.data import leases
from hvd_spark._internal.data.files import StoreFiles, sha256_of

logger = logging.getLogger(__name__)

# Model files of the store's runs (checkpoints, final models): Keras' archives and torch's (ml/framework.py).
MODEL_SUFFIXES = (".keras", ".pt")
_CKPT = re.compile(r"^epoch-(\d{4,})(?:-step-(\d{7,}))?\.json$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_WRITERS = ("auto", "spark", "store")
_SPARK_PROTOCOLS = ("file", "local", "hdfs", "viewfs")  # filesystems every Spark cluster's Hadoop serves


FORMAT_VERSION = 4  # of data/<key>/: 2 had attempt folders and stored column names; 3: one write, stats in meta;
# 4: bigint arrays and groups stored as int64, statistics count infinities and hold element ranges
VAL_COL = "__hvd_spark_is_val"  # data/<key>/<VAL_COL>=true|false/: the validation split
DATA_META = "_hvd_spark_meta.json"  # data/<key>/: names the published files
DATA_USED = "_last_used.json"  # data/<key>/: when a fit last reused it
DATA_READER_PREFIX = "_reading-"  # data/<key>/_reading-<fit>.json: a fit trains on it now (a lease)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the model after ``epoch`` epochs and ``step`` steps of the next one
    (0: an epoch checkpoint; more: a commit inside an epoch, whose metadata holds the data cursor),
    and its metadata (history, ...)."""

    epoch: int
    model_path: str
    meta_path: str
    step: int = 0

    @property
    def position(self) -> str:
        return f"epoch {self.epoch} step {self.step}" if self.step else f"epoch {self.epoch}"


class Store:
    """A location on shared storage.

    Args:
        prefix: a local path or a URL (``file://``, ``hdfs://``, ``s3://``, ...).
        storage_options: keyword arguments for the fsspec filesystem (e.g. an S3 endpoint and
            keys: ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for ``s3fs``). The driver,
            the Spark tasks that write the data and the ranks all use them. Credentials among them
            (``key``, ``secret``, ``token``, ``password``, ... also inside ``client_kwargs``) are
            never saved with an estimator, shown in its params or logged: a loaded estimator
            gets them from the environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
            which s3fs reads), a profile, or a store given again (``est.setStore(Store(...))``).
        parquet_writer: who writes the materialized Parquet: ``"spark"`` (Spark's own writer,
            through the cluster's Hadoop filesystems), ``"store"`` (each Spark task writes its
            partition through this store's fsspec filesystem and storage options, so Spark needs
            no filesystem or credentials for it) or ``"auto"`` (the default: ``"spark"`` for local
            paths and ``hdfs://``, ``"store"`` for every other URL, such as ``s3://``).
        retry_window: seconds an operation on the store is retried while it fails with transient
            errors (connection refused or reset, timeouts, 5xx, throttling), with exponential
            backoff; past it, :class:`hvd_spark.StoreUnavailableError`. None (the default): the
            ``HVD_SPARK_STORE_RETRY_WINDOW`` setting, 120 s unless set. The ranks of a fit use the
            driver's value.

    Example:
        >>> store = Store("/tmp/hvd_spark_store")   # doctest: +SKIP
        >>> est = HorovodEstimator(store=store, ...)  # doctest: +SKIP
        >>> s3 = Store("s3://bucket/prefix", storage_options={"endpoint_url": "http://minio:9000"})  # doctest: +SKIP
    """

    def __init__(
        self,
        prefix: str,
        *,
        storage_options: dict[str, Any] | None = None,
        parquet_writer: str = "auto",
        retry_window: float | None = None,
    ):
        if not isinstance(prefix, str) or not prefix.strip():
            raise ValueError(f"store must be a non-empty path or URL. Received: {prefix!r}.")
        if parquet_writer not in _WRITERS:
            raise ValueError(f"parquet_writer must be one of {list(_WRITERS)}. Received: {parquet_writer!r}.")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict. Received: {type(storage_options).__name__}.")
        if retry_window is not None:
            from hvd_spark._internal.common.settings import parse_seconds

            retry_window = parse_seconds("retry_window", retry_window)
        self._retry_window = retry_window
        self._verified: set[tuple[str, int, str]] = set()  # checkpoint models whose SHA-256 matched
        self.parquet_writer = parquet_writer
        self.storage_options = dict(storage_options or {})
        if "://" not in prefix:
            prefix = os.path.abspath(os.path.expanduser(prefix))
        self.files = StoreFiles(prefix, self.storage_options, retry_window)  # internal: data/files.py
        self.prefix = prefix

    def __setstate__(self, state: dict) -> None:
        # A store pickled before its file operations moved to ``files`` (data/files.py) held them as
        # ``_fs``, ``_root`` and ``_protocol``: such a pickle (a user's callback that captured a store)
        # gets its ``files`` again.
        self.__dict__.update(state)
        if "files" not in state:
            for old in ("_fs", "_root", "_protocol"):
                self.__dict__.pop(old, None)
            self.__dict__.setdefault("_verified", set())
            self.files = StoreFiles(self.prefix, self.storage_options, state.get("_retry_window"))

    @property
    def retry_window(self) -> float:
        """Seconds a failing operation is retried (see the ``retry_window`` argument)."""
        return self.files.retry_window

    @property
    def spark_writes(self) -> bool:
        """Whether Spark's own Parquet writer writes the materialized data (see ``parquet_writer``)."""
        if self.parquet_writer == "auto":
            return self.files.protocol in _SPARK_PROTOCOLS
        return self.parquet_writer == "spark"

    @classmethod
    def create(cls, store) -> "Store":
        """A Store from a Store, a path or a URL."""
        if isinstance(store, Store):
            return store
        if isinstance(store, (str, os.PathLike)):
            return cls(os.fspath(store))
        raise TypeError(f"store must be a path, a URL or a hvd_spark.Store. Received: {type(store).__name__}.")

    def __repr__(self) -> str:  # never the storage options (credentials) nor a password in the URL
        from hvd_spark._internal.common.secrets import url_without_credentials

        return f"Store({url_without_credentials(self.prefix)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Store) and other.to_config() == self.to_config()

    def __hash__(self) -> int:
        return hash(self.prefix)

    # --- plain-data form, for workers and persistence ---
    def to_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "prefix": self.prefix,
            "storage_options": self.storage_options,
            "parquet_writer": self.parquet_writer,
        }
        if self._retry_window is not None:
            config["retry_window"] = self._retry_window
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Store":
        return cls(
            config["prefix"],
            storage_options=config.get("storage_options"),
            parquet_writer=config.get("parquet_writer", "auto"),
            retry_window=config.get("retry_window"),
        )

    # --- paths ---
    def run_path(self, run_id: str) -> str:
        validate_run_id(run_id)
        return self.files.path("runs", run_id)

    def checkpoints_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "checkpoints")

    def get_checkpoint_path(self, run_id: str) -> str:
        """horovod.spark's name for where a run's checkpoints go: :meth:`checkpoints_path` (a folder,
        created by the run's first checkpoint)."""
        return self.checkpoints_path(run_id)

    def exists(self, path: str) -> bool:
        """Whether ``path`` (a path of this store, as its ``*_path`` methods give, or its URL) exists
        (horovod.spark's ``Store.exists``)."""
        from fsspec.core import strip_protocol

        return self.files.exists(strip_protocol(path))

    def logs_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "logs")

    def outputs_path(self, run_id: str) -> str:
        """What rank 0's callbacks wrote to relative paths (CSVLogger, TensorBoard, ModelCheckpoint)."""
        return posixpath.join(self.run_path(run_id), "outputs")

    def models_path(self, run_id: str) -> str:
        return posixpath.join(self.run_path(run_id), "models")

    def model_path(self, run_id: str, fit_id: str | None = None, suffix: str = ".keras") -> str:
        """The final model of one fit of a run (``fit_id``; each fit writes its own and none is ever
        rewritten, so a fitted transformer keeps its model; ``suffix``: its framework's, ``.keras`` or
        ``.pt``), or without ``fit_id`` the newest fit's."""
        if fit_id is not None:
            return posixpath.join(self.models_path(run_id), f"{fit_id}{suffix}")
        names = [n for n in self.files.listdir(self.models_path(run_id)) if n.endswith(MODEL_SUFFIXES)]
        if names:  # fit ids start with their time: the last name is the newest
            return posixpath.join(self.models_path(run_id), sorted(names)[-1])
        return posixpath.join(self.run_path(run_id), "model.keras")  # a run of an earlier version

    # --- checkpoints ---
    def checkpoints(self, run_id: str) -> list[Checkpoint]:
        """The checkpoints of a run whose two files exist, oldest first (their contents are checked by
        :meth:`latest_checkpoint`)."""
        ckpt_dir = self.checkpoints_path(run_id)
        names = set(self.files.listdir(ckpt_dir))
        out = []
        for name in names:
            m = _CKPT.match(name)
            model_name = next((name[: -len(".json")] + x for x in MODEL_SUFFIXES if name[:-5] + x in names), "")
            if m and model_name:
                step = int(m.group(2)) if m.group(2) else 0
                model = posixpath.join(ckpt_dir, model_name)
                out.append(Checkpoint(int(m.group(1)), model, posixpath.join(ckpt_dir, name), step))
        return sorted(out, key=lambda c: (c.epoch, c.step))

    def latest_checkpoint(self, run_id: str, *, deep: bool = True, set_aside: bool = False) -> Checkpoint | None:
        """The newest checkpoint of a run that is whole: its JSON reads, and its model file has the
        size (and, with ``deep``, the SHA-256) the JSON records. Damaged ones (a partial upload, a
        full disk, a manual copy) are skipped with a warning naming them; with ``set_aside`` (the fit
        that holds the run's lease and resumes from an older one) they are moved to
        ``checkpoints/damaged/``, so that the epochs they held are trained and written again."""
        for ckpt in reversed(self.checkpoints(run_id)):
            damage = checkpoint_damage(self, ckpt, deep)
            if damage is None:
                return ckpt
            logger.warning(
                "run '%s': the checkpoint of %s in %s is damaged (%s); %s",
                run_id,
                ckpt.position,
                self.files.url(posixpath.dirname(ckpt.meta_path)),
                damage,
                "moved to checkpoints/damaged/, resuming from an older one" if set_aside else "using an older one",
            )
            if set_aside:
                _set_aside(self, ckpt)
        return None

    # --- what the store holds, and removing it ---
    def datasets(self) -> list[dict[str, Any]]:
        """The data that fits wrote (one entry per ``data/<key>``), oldest use first: ``key``, ``url``,
        ``created`` and ``last_used`` (epoch seconds), ``train_rows``, ``val_rows`` and ``in_use`` (a
        fit is writing or training on it now). Later fits reuse an entry only while their input is
        provably the same (see ``reuse_data``), so entries of changed inputs are dead weight."""
        from hvd_spark._internal.common import settings

        out = []
        root = self.files.path("data")
        for key in self.files.listdir(root):
            folder = posixpath.join(root, key)
            try:
                meta = self.files.read_json(posixpath.join(folder, DATA_META))
            except (FileNotFoundError, ValueError):
                meta = {}
            created = float(meta.get("created") or self.files.mtime(folder))
            used, released = self._last_use(folder)
            live = leases.live_leases(self.files, folder, "_writing-", settings.LEASE_STALE) + leases.live_leases(
                self.files, folder, DATA_READER_PREFIX, settings.LEASE_STALE
            )
            out.append(
                {
                    "key": key,
                    "url": self.files.url(folder),
                    "created": created,
                    "last_used": max(created, used or 0.0),
                    "train_rows": meta.get("train_rows"),
                    "val_rows": meta.get("val_rows"),
                    # A fit that reused it a moment ago takes its reading lease right after (unless that
                    # lease has ended already: released).
                    "in_use": bool(live)
                    or (used is not None and not released and time.time() - used < settings.LEASE_STALE),
                }
            )
        return sorted(out, key=lambda d: d["last_used"])

    def runs(self) -> list[dict[str, Any]]:
        """The runs in the store, oldest activity first: ``run_id``, ``url``, ``created``, ``last_active``
        (its newest checkpoint or model, epoch seconds), ``epochs`` (of its newest complete checkpoint),
        ``models`` (final models of its fits) and ``in_use`` (a fit is training it now)."""
        out = []
        for run_id in self.files.listdir(self.files.path("runs")):
            if not _RUN_ID.match(run_id):
                continue
            folder = self.run_path(run_id)
            latest = self.latest_checkpoint(run_id, deep=False)
            models = [n for n in self.files.listdir(self.models_path(run_id)) if n.endswith(MODEL_SUFFIXES)]
            try:
                created = float(self.files.read_json(posixpath.join(folder, "run.json")).get("created") or 0.0)
            except (FileNotFoundError, ValueError):
                created = self.files.mtime(folder)
            times = [created] + ([self.files.mtime(latest.meta_path)] if latest else [])
            times += [self.files.mtime(posixpath.join(self.models_path(run_id), m)) for m in sorted(models)[-1:]]
            out.append(
                {
                    "run_id": run_id,
                    "url": self.files.url(folder),
                    "created": created,
                    "last_active": max(times),
                    "epochs": latest.epoch if latest else 0,
                    "models": len(models),
                    "in_use": self._run_in_use(run_id) is not None,
                }
            )
        return sorted(out, key=lambda d: d["last_active"])

    def remove_dataset(self, key: str) -> None:
        """Removes the data a fit wrote under ``data/<key>`` (see :meth:`datasets`). A later fit of the
        same input writes it again. Raises ValueError while a fit is writing or training on it."""
        if not re.match(r"^[A-Za-z0-9._-]+$", key or ""):
            raise ValueError(f"key must be a key listed by Store.datasets(). Received: {key!r}.")
        entry = next((d for d in self.datasets() if d["key"] == key), None)
        if entry is None:
            raise ValueError(f"the store {self.prefix} holds no data with key {key!r}; see Store.datasets().")
        if entry["in_use"]:
            raise ValueError(
                f"data {key} in {self.prefix} is in use by a fit right now; remove it once that fit ended."
            )
        self.files.rm(data_path(self, key))

    def remove_run(self, run_id: str) -> None:
        """Removes a run: its checkpoints, logs and final models. A transformer fitted in it can no
        longer load its model (save it first: ``TFTransformer.save``). Raises
        :class:`hvd_spark.RunInUseError` while a fit trains the run."""
        from hvd_spark.errors import RunInUseError

        holder = self._run_in_use(run_id)
        if holder is not None:
            raise RunInUseError(
                f"run_id '{run_id}' in {self.prefix} is being trained right now (host {holder.get('host')}, pid "
                f"{holder.get('pid')}); remove it once that fit ended.",
                run_id=run_id,
                holder={k: v for k, v in holder.items() if k != "token"},
            )
        if not self.files.exists(self.run_path(run_id)):
            raise ValueError(f"the store {self.prefix} holds no run {run_id!r}; see Store.runs().")
        self.files.rm(self.run_path(run_id))

    def cleanup(
        self, *, older_than: float, datasets: bool = True, runs: bool = False, dry_run: bool = False
    ) -> list[str]:
        """Removes what no fit used for ``older_than`` seconds: data (``datasets``, default) and runs
        (``runs``, off by default: a run holds trained models), never anything in use. Returns the URLs
        removed (with ``dry_run``, those that would be).

        Example:
            >>> store.cleanup(older_than=7 * 86400)   # data unused for a week  # doctest: +SKIP
        """
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or older_than < 0:
            raise ValueError(f"older_than must be a number of seconds >= 0. Received: older_than={older_than!r}.")
        cutoff = time.time() - older_than
        entries = [(d, d["last_used"], data_path(self, d["key"])) for d in (self.datasets() if datasets else [])]
        entries += [(r, r["last_active"], self.run_path(r["run_id"])) for r in (self.runs() if runs else [])]
        removed = []
        for entry, last, path in entries:
            if not entry["in_use"] and last < cutoff:
                if not dry_run:
                    self.files.rm(path)
                removed.append(entry["url"])
        return removed

    def _run_in_use(self, run_id: str) -> dict[str, Any] | None:
        """The writer lease of a fit training ``run_id`` now, or None."""
        from hvd_spark._internal.common import settings

        try:
            held = self.files.read_json(posixpath.join(self.run_path(run_id), "_writer.json"))
        except (FileNotFoundError, ValueError):
            return None
        return held if time.time() - float(held.get("heartbeat", 0)) < settings.run_lease_stale() else None

    def _last_use(self, folder: str) -> tuple[float | None, bool]:
        """When a fit last used the data in ``folder``, and whether its reading lease ended since."""
        try:
            used = self.files.read_json(posixpath.join(folder, DATA_USED))
            return float(used.get("time")), bool(used.get("released"))
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return None, False


def job_config(store: Store) -> dict[str, Any]:
    """:meth:`Store.to_config` for the processes of a job: the retry window resolved here, so that every
    rank retries as long as the driver does."""
    return dict(store.to_config(), retry_window=store.retry_window)


def data_path(store: Store, key: str) -> str:
    """The folder of the data a fit wrote under ``key`` (``data/<key>``)."""
    return store.files.path("data", key)


def release_data(store: Store, key: str, taken: float) -> None:
    """Records that a fit's reading lease on ``data/<key>``, taken at ``taken``, has ended: its last use
    is now, and no fit is about to take a lease (``Store.datasets``' ``in_use`` stops counting the
    minute after a reuse), so ``Store.cleanup`` may remove it at once. Unless another fit reused the
    data after ``taken``: its lease comes, and the mark stays as it wrote it."""
    path = posixpath.join(data_path(store, key), DATA_USED)
    try:
        used = store.files.read_json(path)
    except (FileNotFoundError, ValueError):
        used = {}
    if isinstance(used, dict) and not used.get("released") and float(used.get("time") or 0.0) > taken:
        return
    store.files.write_json(path, {"time": time.time(), "released": True})


def epoch_checkpoints(store: Store, run_id: str) -> list[Checkpoint]:
    """The checkpoints at epoch ends, oldest first (no commits inside an epoch)."""
    return [c for c in store.checkpoints(run_id) if not c.step]


def remove_commits_before(store: Store, run_id: str, epoch: int, step: int) -> None:
    """Removes the commits inside an epoch older than ``(epoch, step)``: once a newer checkpoint
    is complete they are never resumed from. Epoch checkpoints stay."""
    for c in store.checkpoints(run_id):
        if c.step and (c.epoch, c.step) < (epoch, step):
            for path in (c.meta_path, c.model_path):  # the JSON first: never a JSON without its model
                with contextlib.suppress(FileNotFoundError):
                    store.files.rm(path)


def prune_checkpoints(store: Store, run_id: str, keep: int, *, also: int | None = None) -> list[Checkpoint]:
    """Removes the run's epoch checkpoints but the newest ``keep`` (``keep_checkpoints``) and the one of
    epoch ``also`` (the checkpoint a fit resumed from: kept until it ends). Only once the newest is
    whole by its recorded size (else nothing goes: a resume may need the older ones); never a commit
    inside an epoch (the newest checkpoint removed those before it). Returns those removed."""
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be at least 1. Received: keep_checkpoints={keep}.")
    epochs = epoch_checkpoints(store, run_id)
    if len(epochs) <= keep or checkpoint_damage(store, epochs[-1], deep=False) is not None:
        return []
    kept = {also, *best_epochs(store, epochs[-1])}  # and EarlyStopping's best weights (rank/carried.py)
    removed = [c for c in epochs[:-keep] if c.epoch not in kept]
    for c in removed:
        for path in (end_record_path(store, run_id, c.epoch), c.meta_path, c.model_path):  # JSONs first
            with contextlib.suppress(FileNotFoundError):
                store.files.rm(path)
    return removed


def best_epochs(store: Store, ckpt: Checkpoint) -> list[int]:
    """The epochs whose checkpoints hold the best weights of an EarlyStopping with ``restore_best_weights``,
    as recorded with ``ckpt`` (its JSON's ``callbacks``: rank/carried.py)."""
    records = store.files.read_json(ckpt.meta_path).get("callbacks") or ()
    states = [(r or {}).get("state") or {} for r in records]
    return [
        int(s.get("best_epoch") or 0) + 1 for s in states if s.get("restore_best_weights") and s.get("best") is not None
    ]


def remove_checkpoints_after(store: Store, run_id: str, after: Checkpoint | None) -> None:
    """Removes the run's checkpoints and commits written after ``after`` (None: all of them), in
    training order: epoch ``e``'s checkpoint ``(e, 0)``, then the commits inside epoch ``e + 1``
    (``epoch-000e-step-N``: ``(e, N)``), then epoch ``e + 1``'s checkpoint (with its end record)."""
    start = (after.epoch, after.step) if after is not None else (-1, 0)
    for c in store.checkpoints(run_id):
        if (c.epoch, c.step) > start:
            end = () if c.step else (end_record_path(store, run_id, c.epoch),)
            for path in (*end, c.meta_path, c.model_path):  # the JSONs first: never a JSON without its model
                with contextlib.suppress(FileNotFoundError):
                    store.files.rm(path)


def end_record_path(store: Store, run_id: str, epoch: int) -> str:
    """``checkpoints/epoch-NNNN-end.json``: the model a run stopped early at epoch ``NNNN`` ends with."""
    return posixpath.join(store.checkpoints_path(run_id), f"epoch-{epoch:04d}-end.json")


def checkpoint_damage(store: Store, ckpt: Checkpoint, deep: bool) -> str | None:
    """What is wrong with ``ckpt``'s files, or None. Errors of an unreachable store are raised
    (StoreUnavailableError), never taken for damage."""
    try:
        meta = store.files.read_json(ckpt.meta_path)
    except FileNotFoundError:
        return f"{posixpath.basename(ckpt.meta_path)} is gone"
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"{posixpath.basename(ckpt.meta_path)} does not read as JSON: {retry.one_line(e)}"
    name = posixpath.basename(ckpt.model_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("history", []), list):
        return f"{posixpath.basename(ckpt.meta_path)} is not a checkpoint's metadata"
    size = store.files.sizes(posixpath.dirname(ckpt.model_path)).get(name)
    if size is None:
        return f"{name} is gone"
    expected = meta.get("model_bytes")
    if expected is not None and int(expected) != int(size):
        return f"{name} holds {size} bytes, {expected} were written"
    digest = meta.get("model_sha256")
    if not deep or (digest is None and expected is not None):
        return None
    if digest is not None:
        if (ckpt.model_path, size, digest) in store._verified:
            return None
        actual = store.files.retrying(
            f"reading {store.files.rel(ckpt.model_path)}", lambda: store.files.sha256(ckpt.model_path)
        )
        if actual != digest:
            return f"{name}'s SHA-256 is {actual[:12]}..., {digest[:12]}... was written"
        store._verified.add((ckpt.model_path, size, digest))
        return None
    # A checkpoint of an earlier version records neither: a .keras (or .pt) file is a zip archive, whose
    # directory at its end is missing when the file was cut short.
    import zipfile

    def readable() -> bool:
        with store.files.fs.open(ckpt.model_path, "rb") as f:
            return zipfile.is_zipfile(f)

    if not store.files.retrying(f"reading {store.files.rel(ckpt.model_path)}", readable):
        return f"{name} is not a whole .keras archive"
    return None


def _set_aside(store: Store, ckpt: Checkpoint) -> None:
    """Moves a damaged checkpoint's files to ``checkpoints/damaged/`` (kept, never deleted)."""
    folder = posixpath.join(posixpath.dirname(ckpt.meta_path), "damaged")
    store.files.makedirs(folder)
    for path in (ckpt.meta_path, ckpt.model_path):  # the JSON first: never a JSON without its model
        dest = posixpath.join(folder, f"{int(time.time())}-{posixpath.basename(path)}")
        with contextlib.suppress(FileNotFoundError):
            store.files.retrying(
                f"moving {store.files.rel(path)} aside", functools.partial(store.files.fs.mv, path, dest)
            )


def file_digest(local: str) -> dict[str, Any]:
    """What a checkpoint's JSON records of its model file (a local file): ``model_bytes`` and
    ``model_sha256``."""
    with open(local, "rb") as f:
        return {"model_bytes": os.path.getsize(local), "model_sha256": sha256_of(f)}


def checkpoint_names(epoch: int, step: int = 0, suffix: str = ".keras") -> tuple[str, str]:
    """The files of the checkpoint after ``epoch`` epochs and ``step`` steps of the next one (``suffix``:
    the model file's, ``.keras`` or torch's ``.pt``)."""
    stem = f"epoch-{epoch:04d}" + (f"-step-{step:07d}" if step else "")
    return f"{stem}{suffix}", f"{stem}.json"


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            "run_id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit. "
            f"Received: {run_id!r}."
        )
    return run_id
