"""Shared fixtures: one local[2] SparkSession for the whole test run (Spark is slow to start)."""

import os
import sys

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _petastorm() -> bool:
    try:
        import petastorm.reader  # noqa: F401

        return True
    except Exception:  # ImportError, or pyarrow >= 13's missing pyarrow.filesystem
        return False


def _arrow_udf() -> bool:
    try:
        from pyspark.sql.functions import arrow_udf  # noqa: F401

        return True
    except ImportError:
        return False


# Features that exist on some Spark lines only (README, "Spark lines"). A test or parameter marked
# with one is not collected where the line lacks it: CI runs it on a line that has it, and a skip in
# the report always means something went missing that this line should have.
LINE_FEATURES = {
    "petastorm": ("Petastorm 0.13.1, which needs pyarrow 12: the Spark 3.5 line", _petastorm),
    "arrow_udf": ("Arrow UDFs (pyspark.sql.functions.arrow_udf): pyspark >= 4.1, the 4.3 line", _arrow_udf),
}


MANUAL_TIERS = ("multihost", "slow")  # left out unless named in -m


def pytest_configure(config):
    for name, (what, _) in LINE_FEATURES.items():
        config.addinivalue_line("markers", f"{name}: needs {what}; not collected on lines without it")


def pytest_collection_modifyitems(session, config, items):
    """Leaves out what this Spark line cannot run (LINE_FEATURES), then puts the Spark Connect tests
    last: a Connect client switches pyspark into Connect mode for the whole process
    (SPARK_CONNECT_MODE_ENABLED), which classic tests after them would inherit."""
    missing = [
        name
        for name, (_, available) in LINE_FEATURES.items()
        if any(item.get_closest_marker(name) for item in items) and not available()
    ]
    left_out = [item for item in items if any(item.get_closest_marker(name) for name in missing)]
    # The manual tiers run when asked for by their marker: -m multihost (about 14 minutes), -m slow.
    wanted = config.option.markexpr or ""
    tier = [
        item
        for item in items
        if any(item.get_closest_marker(m) and m not in wanted for m in MANUAL_TIERS) and item not in left_out
    ]
    if tier:
        config._hvd_spark_tier_left_out = len(tier)
        left_out += tier
    if left_out:
        items[:] = [item for item in items if item not in left_out]
        config.hook.pytest_deselected(items=left_out)
        config._hvd_spark_left_out = [
            (LINE_FEATURES[name][0], sum(1 for item in left_out if item.get_closest_marker(name))) for name in missing
        ]
    items.sort(key=lambda item: item.get_closest_marker("connect") is not None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for what, count in getattr(config, "_hvd_spark_left_out", []):
        terminalreporter.write_line(f"not on this Spark line: {count} test(s) that need {what}")
    if getattr(config, "_hvd_spark_tier_left_out", 0):
        terminalreporter.write_line(
            f"manual tiers not run ({config._hvd_spark_tier_left_out} tests): bash scripts/test.sh -m multihost, "
            "bash scripts/test.sh -m slow"
        )


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
        prewarm=False,  # tests that count processes take a baseline; test_warm.py tests the prewarm
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
