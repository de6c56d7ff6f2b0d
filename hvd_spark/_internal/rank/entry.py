"""Entry point of one rank's process: ``python -m hvd_spark._internal.rank.entry [WORKDIR]``.

Reads ``WORKDIR/payload.pkl`` (``fn, args, kwargs``, cloudpickled), runs the function and
writes ``result-<rank>.pkl`` on success or ``error-<rank>.pkl`` (an ``outcomes.RankOutcome``:
type, message, traceback, the time it happened and, when it pickles, the exception itself) on
failure. This module
must stay light: it runs before the user's imports and must not import pyspark.
"""

import contextlib
import io
import os
import sys
import time
import traceback

from hvd_spark._internal.common.outcomes import ERROR, RankOutcome


def _rank() -> int:
    for name in ("HVD_SPARK_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def error_outcome(rank: int, exc: BaseException) -> RankOutcome:
    """What the driver needs to report a remote exception, in plain types."""
    import cloudpickle

    pickled = None
    with contextlib.suppress(Exception):  # not every exception pickles; the text still reports it
        pickled = cloudpickle.dumps(exc)
    return RankOutcome(
        rank=rank,
        status=ERROR,
        type=f"{type(exc).__module__}.{type(exc).__qualname__}".replace("builtins.", ""),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        time=time.time(),
        pickled=pickled,
    )


def main(workdir: str) -> int:
    import cloudpickle

    rank = _rank()
    os.environ.setdefault("HVD_SPARK_RANK", str(rank))
    try:
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        result = fn(*args, **(kwargs or {}))
        data = cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
        sys.stderr.flush()
        _write_atomic(os.path.join(workdir, f"error-{rank}.pkl"), cloudpickle.dumps(error_outcome(rank, exc)))
        return 1
    _write_atomic(os.path.join(workdir, f"result-{rank}.pkl"), data)
    return 0


def _finalize_collectives(timeout: float = 20.0) -> None:
    """Shuts Horovod (and with it MPI) down: Horovod's shutdown is agreed by all ranks, so a rank
    that finishes first does not cut its peers' connections under them (Gloo logs a "connection
    reset" error then), and mpirun sees a rank that finished, not one that vanished. Then destroys
    the process group a function left behind (``torch.distributed.init_process_group`` without
    ``destroy_process_group``; an NCCL group's resources are freed, not cut by the exit). Bounded: a
    peer that is stuck must not keep this finished rank alive."""
    import threading

    def shutdown():
        for name in ("horovod.tensorflow", "horovod.torch"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "shutdown"):
                with contextlib.suppress(Exception):
                    module.shutdown()
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            with contextlib.suppress(Exception):
                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()

    t = threading.Thread(target=shutdown, daemon=True)
    t.start()
    t.join(timeout)


def _mpi_torch_env() -> None:
    """In a rank mpirun started: torch.distributed's variables for this rank (a Gloo rank's task sets
    them; mpirun's ranks share one environment, ``task/mpi.py``'s exports, and their MPI rank)."""
    from hvd_spark._internal.common import settings

    sizes = os.environ.get(settings.ENV_NODE_SIZES)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if not sizes or rank is None:
        return
    from hvd_spark._internal.common.topology import mpi_torch_env

    os.environ.update(mpi_torch_env(int(rank), [int(n) for n in sizes.split(",")], dict(os.environ)))


def _gpu_operations() -> None:
    """On a rank with GPUs: NCCL for Horovod's GPU collectives when Horovod has it (before ``hvd.init``)."""
    if not os.environ.get("HVD_SPARK_GPUS"):
        return
    from hvd_spark._internal.common.topology import gpu_operations

    try:
        import horovod.tensorflow as hvd

        nccl = bool(hvd.nccl_built())
    except Exception:  # noqa: BLE001 - no TF extension: nothing to choose
        nccl = False
    os.environ.update(gpu_operations(nccl, dict(os.environ)))


def own_tempdir(workdir: str) -> str:
    """Makes ``WORKDIR/tmp`` this process's temporary folder (``tempfile``'s, and ``TMPDIR`` for what
    it starts): what the rank leaves there (TensorFlow autograph's generated modules, which it removes
    only at an interpreter exit a rank never has; a checkpoint being written; a downloaded model) goes
    with the work folder, which its task removes however the rank ended (``task/barrier.py``). A
    forked rank needs ``tempfile.tempdir`` set: its warm server has cached its own."""
    import tempfile

    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)  # MPI: the ranks of a host share their task's work folder
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    return tmp


def entry(workdir: str) -> int:
    """Runs the payload in ``workdir`` as this process's one job and returns its exit code: what a
    fresh rank process does, and what a rank forked by a warm server does."""
    import faulthandler
    import signal

    # SIGUSR1 prints where this rank is (its Python stack): the launcher asks for it on a timeout.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
    faulthandler.enable(file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    from hvd_spark._internal.common.events import report_init_when_done

    own_tempdir(workdir)
    _mpi_torch_env()
    _gpu_operations()
    report_init_when_done()
    code = main(workdir)
    if code == 0:
        _finalize_collectives()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def forked(workdir: str) -> int:
    """:func:`entry` in a rank forked by a warm server (the task's payload, ``task/barrier.py``),
    marked as warm for the rank's start-up profile (``settings.ENV_WARM_RANK``)."""
    from hvd_spark._internal.common import settings

    os.environ[settings.ENV_WARM_RANK] = "1"
    return entry(workdir)


if __name__ == "__main__":
    # MPI ranks share one command line: each host's workdir comes from the environment instead.
    code = entry(sys.argv[1] if len(sys.argv) > 1 else os.environ["HVD_SPARK_WORKDIR"])
    # The outcome is on disk. Leave without interpreter finalization: some libraries' threads
    # (gRPC servers, data loaders) keep a finished process alive at exit.
    os._exit(code)
