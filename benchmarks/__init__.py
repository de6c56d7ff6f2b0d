"""hvd_spark benchmarks: run ``python -m benchmarks.run`` from the repository root."""
