"""Shared fixtures: one local[2] SparkSession for the whole test run (Spark is slow to start)."""

import os
import sys

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_collection_modifyitems(session, config, items):
    """Spark Connect tests last: a Connect client switches pyspark into Connect mode for the whole
    process (SPARK_CONNECT_MODE_ENABLED), which classic tests after them would inherit."""
    items.sort(key=lambda item: item.get_closest_marker("connect") is not None)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    import hvd_spark

    local_dir = tmp_path_factory.mktemp("spark-local")
    session = hvd_spark.local_session(
        "local[2]",
        app_name="hvd_spark-tests",
        conf={
            "spark.local.dir": str(local_dir),
            "spark.sql.warehouse.dir": str(local_dir / "warehouse"),
            "spark.driver.memory": "2g",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
