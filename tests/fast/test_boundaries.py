"""The rules between the places where code runs, checked in fresh interpreters, one package at a
time: every module of a package is imported and must load none of that package's forbidden
libraries. A new module lands in a package and gets its rule; a new top-level import that breaks
the rule fails here."""

import pathlib
import subprocess
import sys

import pytest

import hvd_spark

HEAVY = ("tensorflow", "keras", "horovod", "pyspark", "pyspark.ml", "petastorm")
INTERNAL = pathlib.Path(hvd_spark.__file__).parent / "_internal"

# package (under hvd_spark._internal), libraries none of its modules may load at import
PACKAGES = {
    "common": HEAVY,
    "driver": ("tensorflow", "keras", "horovod", "pyspark.ml", "petastorm"),
    "task": ("tensorflow", "keras", "pyspark"),
    "rank": ("pyspark",),
    "infer": ("horovod", "petastorm"),
    "data": ("tensorflow", "keras", "horovod", "petastorm"),
    "ml": ("horovod", "petastorm"),
}
# modules with a stricter rule than their package's
MODULES = {
    "hvd_spark": HEAVY,
    "hvd_spark.errors": HEAVY,
    "hvd_spark._internal.common.service": HEAVY,  # the wire protocol: tasks and ranks speak it
    "hvd_spark._internal.data.store": HEAVY,  # ranks read and write the store
    "hvd_spark._internal.data.files": HEAVY,  # the store's file operations (ranks, tasks)
    "hvd_spark._internal.data.leases": HEAVY,  # the leases of a write, a fit, a run
    "hvd_spark._internal.driver.progress": HEAVY,
    "hvd_spark._internal.driver.tracking": HEAVY,  # MLflow (which loads a part of pyspark) only inside functions
    "hvd_spark._internal.infer.batching": HEAVY,  # pure: the fast tests drive it
    "hvd_spark._internal.infer.device": HEAVY,
    "hvd_spark._internal.infer.cache": HEAVY,
    "hvd_spark._internal.rank.entry": ("tensorflow", "keras", "pyspark"),  # runs any function given to run()
}


def _modules(package: str) -> list[str]:
    return sorted(
        f"hvd_spark._internal.{package}.{p.stem}" for p in (INTERNAL / package).glob("*.py") if p.stem != "__init__"
    )


def _loaded(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    code = f"import sys, {', '.join(modules)}\nprint(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_every_module_is_in_a_package_with_a_rule():
    loose = sorted(p.name for p in INTERNAL.glob("*.py") if p.stem != "__init__")
    assert loose == [], f"modules outside a package: {loose}"
    packages = sorted(p.name for p in INTERNAL.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(PACKAGES)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_loads_nothing_forbidden(package):
    modules = _modules(package)
    assert modules
    assert _loaded(modules, PACKAGES[package]) == [], f"importing {package}'s modules loaded forbidden libraries"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_loads_nothing_forbidden(module):
    assert _loaded([module], MODULES[module]) == []
