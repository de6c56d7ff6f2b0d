"""Typed records that cross a boundary: the driver's run configuration for the ranks, and what a
fit reports back to its caller.

Plain frozen dataclasses: no Spark, Keras or Horovod, so they are cheap to import anywhere.
"""

from dataclasses import dataclass, field
from typing import Any

from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec


@dataclass(frozen=True)
class RankSummary:
    """What one rank reports at the end of training."""

    rank: int
    weights_digest: str  # a hash of every weight: equal on every rank when averaging held
    iterations: int | None = None  # the optimizer's step counter (continues across resumes)
    start_iterations: int | None = None  # the counter when the last training attempt started
    train_seconds: float | None = None  # time inside model.fit on this rank
    state_reconciled: int | None = None  # layer-state variables averaged across ranks (BatchNormalization ...)
    host: str | None = None  # the address of the host the rank ran on
    startup: dict[str, float] | None = None  # seconds per start phase (fit_callbacks.Startup); "warm": 1.0 if forked

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> "RankSummary":
        return cls(
            rank=int(result["rank"]),
            weights_digest=str(result.get("weights_digest", "")),
            iterations=result.get("iterations"),
            start_iterations=result.get("start_iterations"),
            train_seconds=result.get("train_seconds"),
            state_reconciled=result.get("state_reconciled"),
            host=result.get("host"),
            startup=result.get("startup"),
        )


@dataclass(frozen=True)
class Recovery:
    """One restart or resize of a fit's training job."""

    kind: str  # "restart" (as many ranks as before), "shrink" (fewer: slots were lost) or "grow"
    cause: str  # the failure's first line, or why training grew
    from_size: int  # ranks before
    to_size: int  # ranks after
    resumed_from: str  # the commit the next attempt started from: "epoch 2 step 40", "epoch 3", "the start"
    # optimizer steps the stopped attempt had made past that commit, as rank 0 last reported them
    # (every 0.5 s: the last half second may be missing); None: unknown
    steps_redone: int | None
    lost_hosts: tuple[str, ...] = ()  # hosts whose executor or network went away
    seconds: float | None = None  # from the failure (or the stop) to the next attempt's first step

    def describe(self) -> str:
        took = f"{self.seconds:.1f}s to the next first step" if self.seconds is not None else "time unknown"
        redone = "unknown" if self.steps_redone is None else str(self.steps_redone)
        lost = f", lost {', '.join(self.lost_hosts)}" if self.lost_hosts else ""
        return (
            f"{self.kind} {self.from_size} -> {self.to_size} ranks from {self.resumed_from}{lost}; "
            f"{redone} step(s) redone; {took}; cause: {self.cause}"
        )


@dataclass(frozen=True)
class FitSummary:
    """How a ``fit`` went: ``TFTransformer.getFitSummary()`` on the model it returned.

    ``None`` there for a model that was loaded, or returned from a finished run without training.
    """

    run_id: str
    data_key: str  # the materialized data's folder under data/ in the store
    steps_per_epoch: int  # per rank
    restarts: int  # failed training attempts that were restarted from a checkpoint
    materialize_seconds: float
    train_job_seconds: float  # the training job(s): launch, training and shutdown of every attempt
    fit_seconds: float
    ranks: tuple[RankSummary, ...]
    recoveries: tuple[Recovery, ...] = ()  # every restart and resize of the training job, in order


@dataclass(frozen=True)
class DataSpec:
    """The columns a fit reads and the model tensors they feed: one value from the driver's checks
    through materialization to each rank's reader."""

    features: tuple[ColumnInfo, ...]
    labels: tuple[ColumnInfo, ...]
    weight: ColumnInfo | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # a shape per label: horovod.spark's label_shapes, or a sparse loss's per-step (per-pixel) class indices
    # (specs.label_shapes); None for a label the reader shapes as its output (or () for one value per row)
    label_shapes: tuple[tuple[int, ...] | None, ...] | None = None

    def reader_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``reader.rank_dataset`` that describe the data."""
        return {
            "features": list(self.features),
            "labels": list(self.labels),
            "weight": self.weight,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "label_shapes": self.label_shapes,
        }


@dataclass(frozen=True)
class Reading:
    """What the ranks read and how: the data plan (``common/dataplan.py``, ``rank/epochs.py``'s
    ``DataPlan``), the readers (``rank/inputs.py``, ``rank/torch_parts.py``, ``rank/lightning_train.py``)
    and their params; the driver's ``ml/controller.sized`` turns it into each size's :class:`Shares`."""

    batch_size: int
    val_batch_size: int
    shuffle: bool
    shuffle_buffer_size: int
    reader: str  # "arrow" or "petastorm"
    train_paths: tuple[str, ...] = ()  # the training files, in the order the units number them
    train_units: tuple[tuple[int, int, int], ...] = ()  # (file, row group, rows) of each row group with rows
    train_table: tuple[tuple[str, int], ...] = ()  # (path, rows): files spread per rank for any size (petastorm)
    val_table: tuple[tuple[str, int], ...] = ()
    source: Any = None  # sources.TableSource: train_paths are a table read in place (None: the store's copy)
    val_units: tuple[tuple[int, int, int], ...] = ()  # in place: (file, row group, validation rows) of train_paths
    fixed_steps: int | None = None  # the user's train_steps_per_epoch (None: each rank's share once)
    fixed_val_steps: int | None = None  # the user's validation_steps_per_epoch
    validation_exact: bool = True  # every validation row counted once (False: validation_steps per rank)
    # --- horovod.spark's reader params ---
    prefetch: int = 0  # tensorflow_dataset_prefetch_buffer_size (0: AUTOTUNE)
    reader_workers: tuple[int, int] = (2, 2)  # threads reading row groups ahead: training, validation
    transformation_fn: bytes | None = None  # cloudpickled fn(pandas.DataFrame) -> pandas.DataFrame per block
    cache_all: bool = False  # inmemory_cache_all: keep every row group read


@dataclass(frozen=True)
class Shares:
    """Each rank's share at one world size (``ml/controller.sized``, again for every size of an elastic
    fit): its files (the petastorm reader), its validation files, and the steps of an epoch."""

    train_files: list[list[str]]  # per rank
    val_files: list[list[str]] | None  # per rank, or no validation
    steps_per_epoch: int
    validation_steps: int | None


@dataclass(frozen=True)
class Training:
    """The model's setup and how it trains (``rank/model.py``, ``rank/train.py``'s ``model.fit``,
    ``rank/torch_parts.py``, ``rank/lightning_train.py``'s Trainer, ``rank/fit_callbacks.py``)."""

    # optimizer / loss / metrics given as Params (serialized Keras objects), loss_weights, learning_rate, and
    # what a saved model does not carry: the model's dtype policy and compile's auto_scale_loss
    compile: dict[str, Any]
    custom_objects: bytes | None = None  # cloudpickled
    callbacks: bytes | None = None  # cloudpickled list of keras callbacks
    checkpoint_callback: bytes | None = None  # cloudpickled ModelCheckpoint run on rank 0 (the model returned)
    backward_passes_per_step: int = 1  # batches accumulated per allreduce (Keras gradient accumulation)
    compression: str = "none"  # "none" or "fp16" gradients in the allreduce
    # --- keras.Model.fit's own arguments ---
    class_weight: dict[int, float] | None = None
    validation_freq: int | tuple[int, ...] = 1  # every N epochs, or these epochs (1-based)


@dataclass(frozen=True)
class Commits:
    """What rank 0 writes to the run in the store, where and when: its commits (checkpoints) and which
    are kept, under the run's writer lease; the model at the end; and the resize marker it looks for at
    each epoch end (``ml/policies.GrowWatch`` writes it)."""

    final_model: str = ""  # where rank 0 saves the trained model: this fit's own file in the store
    lease: tuple[str, str] | None = None  # (path, token) of the run's writer lease, checked before each checkpoint
    checkpoint_steps: int | None = None  # commits inside an epoch every N steps
    checkpoint_seconds: float | None = None  # or every so many seconds (rank 0's clock)
    keep_checkpoints: int | None = None  # the newest N epoch checkpoints kept (None: all)
    kept_from: int | None = None  # the epoch of the checkpoint this fit resumed from: kept until the fit ends
    resize_marker: str | None = None  # store path the driver writes when training should grow


@dataclass(frozen=True)
class AttemptStart:
    """Where one training attempt starts (``ml/controller.FitJob``, anew for every attempt): the run's
    latest commit, or the user's model."""

    initial_epoch: int = 0
    resume_ckpt: str | None = None  # checkpoint model path in the store, when resuming
    history_so_far: tuple[dict[str, float], ...] = ()
    model_bytes: bytes | None = None  # the user's model as a .keras file, when not resuming
    resume_step: int = 0  # steps of epoch initial_epoch + 1 the resumed commit holds (0: an epoch end)
    resume_cursor: dict | None = None  # that commit's data cursor (dataplan.Cursor.to_json())
    # the user's stateful callbacks as that checkpoint recorded them (rank/carried.py's capture)
    callback_states: tuple | None = None


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to train (``worker.train``), built by the driver (``ml/steps.plan_ranks``);
    plain data and bytes, so it pickles without Spark. The run-wide fields, and a record per reader:
    :class:`Reading` (the data plan and readers), :class:`Training` (the model and its training),
    :class:`Commits` (what rank 0 writes to the store); and two that change through
    ``dataclasses.replace``: :class:`Shares` with the world size (``ml/controller.sized``) and
    :class:`AttemptStart` with every attempt of a fit (``ml/controller.FitJob``)."""

    store: dict[str, Any]  # Store.to_config()
    run_id: str
    epochs: int
    data: DataSpec
    seed: int
    verbose: int
    progress_interval: float  # seconds between rank 0's in-epoch progress events; 0: none
    num_threads: int
    reading: Reading
    training: Training
    shares: Shares
    commits: Commits = field(default_factory=Commits)
    start: AttemptStart = field(default_factory=AttemptStart)


def history_from(logs_per_epoch: list[dict[str, float]]) -> dict[str, list[float]]:
    """Turns a list of per-epoch logs into Keras' ``History.history`` layout (metric -> values)."""
    history: dict[str, list[float]] = {}
    for logs in logs_per_epoch:
        for k, v in logs.items():
            history.setdefault(k, []).append(float(v))
    return history
