"""Implementation modules of hvd_spark. Nothing here is public API."""
