"""Helpers shared by test modules (conftest.py files are not importable by name: there are two)."""


def horovod_mpi_built() -> bool:
    try:
        import horovod.tensorflow as hvd

        return bool(hvd.mpi_built())
    except ImportError:
        return False
