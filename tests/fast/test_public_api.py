"""The public surface of a Store: what users call (no Spark, no TF)."""

import hvd_spark

# What users call on a Store (docs/estimator.md, "Store"); everything else is internal (``files``: the
# store's file operations, for hvd_spark's own packages).
STORE_PUBLIC = {
    "files",
    "create",
    "prefix",
    "storage_options",
    "parquet_writer",
    "spark_writes",
    "retry_window",
    "run_path",
    "outputs_path",
    "model_path",
    "models_path",
    "datasets",
    "runs",
    "remove_dataset",
    "remove_run",
    "cleanup",
    "checkpoints_path",
    "get_checkpoint_path",
    "exists",
    "logs_path",
    "checkpoints",
    "latest_checkpoint",
    "to_config",
    "from_config",
}


def test_store_public_members_are_the_documented_ones(tmp_path):
    store = hvd_spark.Store(str(tmp_path))
    public = {n for n in dir(store) if not n.startswith("_")}
    assert public == STORE_PUBLIC


def test_checkpoints_are_listed_through_the_public_api(tmp_path):
    store = hvd_spark.Store(str(tmp_path))
    assert store.latest_checkpoint("r1") is None
    folder = tmp_path / "runs" / "r1" / "checkpoints"
    folder.mkdir(parents=True)
    for epoch in (1, 2, 3):
        (folder / f"epoch-{epoch:04d}.keras").write_bytes(b"m")
    for epoch in (1, 2):  # epoch 3 has no metadata: incomplete, not listed
        (folder / f"epoch-{epoch:04d}.json").write_text('{"model_bytes": 1}')
    ckpts = store.checkpoints("r1")
    assert [c.epoch for c in ckpts] == [1, 2]
    assert isinstance(ckpts[0], hvd_spark.Checkpoint)
    assert store.latest_checkpoint("r1") == ckpts[-1]
    assert ckpts[-1].model_path == store.checkpoints_path("r1") + "/epoch-0002.keras"


def test_the_parquet_writer_follows_the_store_and_is_checked(tmp_path):
    import pytest

    assert hvd_spark.Store(str(tmp_path)).spark_writes  # a local path: Spark's own writer
    assert not hvd_spark.Store(str(tmp_path), parquet_writer="store").spark_writes
    assert not hvd_spark.Store("memory://bucket/x").spark_writes  # a URL Spark's Hadoop does not serve
    assert hvd_spark.Store("memory://bucket/x", parquet_writer="spark").spark_writes
    restored = hvd_spark.Store.from_config(hvd_spark.Store("memory://b/x", parquet_writer="store").to_config())
    assert restored.parquet_writer == "store"
    with pytest.raises(ValueError, match=r"parquet_writer must be one of \['auto', 'spark', 'store'\]\. Received: 'x'"):
        hvd_spark.Store(str(tmp_path), parquet_writer="x")


def test_horovod_spark_store_names(tmp_path):
    """A horovod.spark Store's get_checkpoint_path and exists, as its tests use them around a fit."""
    store = hvd_spark.Store(str(tmp_path))
    ckpt = store.get_checkpoint_path("run01")
    assert ckpt == store.checkpoints_path("run01") and not store.exists(ckpt)
    (tmp_path / "runs" / "run01" / "checkpoints").mkdir(parents=True)
    assert store.exists(ckpt) and store.exists(store.files.url(ckpt))  # the path, or its URL
    assert not store.exists(store.run_path("other"))
