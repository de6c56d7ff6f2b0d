"""Claims of the docs checked against the code, so that they cannot drift (issue 47.7 found four of 25
only partly true): the Params' default column against ``fit_params.DEFAULTS`` and the settings, ``run``'s
signature in docs/launcher.md, the fitted ``TFTransformer``'s setters, the count of horovod.spark's
``KerasEstimator`` params, the version table against ``pyproject.toml`` and ``constraints/``, and the
install commands (hvd_spark is on no package index: it installs from a clone).

docs/settings.md is checked by test_settings.py, the Params' groups by test_param_table.py."""

import ast
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import hvd_spark
from hvd_spark._internal.common import settings
from hvd_spark._internal.ml.fit_params import DEFAULTS

ROOT = pathlib.Path(__file__).resolve().parents[2]
ESTIMATOR_MD = (ROOT / "docs" / "estimator.md").read_text()
README = (ROOT / "README.md").read_text()


def _param_cells() -> dict[str, str]:
    """``{param: default cell}`` of the docs' three Params tables (a row of several names, ``a, b`` in
    the default cell, gives each its own)."""
    cells: dict[str, str] = {}
    current = False
    for line in ESTIMATOR_MD.splitlines():
        if line.startswith("### Params: "):
            current = True
        elif line.startswith("#"):
            current = False
        elif current and line.startswith("| `"):
            _, names_cell, default, *_ = line.split("|")
            names = re.findall(r"`(\w+)`", names_cell)
            default = default.strip()
            parts = [p.strip() for p in default.split(", ")]
            for i, name in enumerate(names):
                cells[name] = parts[i] if len(parts) == len(names) else default
    return cells


def _shown(value) -> str:
    """A default as the docs' tables show it: numbers and booleans bare, strings quoted in backticks."""
    if isinstance(value, str):
        return f'`"{value}"`'
    return str(value)


def test_the_default_column_is_what_get_or_default_returns():
    cells = _param_cells()
    assert sorted(cells) == sorted(DEFAULTS)
    wrong = {}
    for name, value in DEFAULTS.items():
        cell = cells[name]
        if value is None:
            if not (cell in ("`None`", "required", "unset") or cell.startswith("unset: ")):
                wrong[name] = (cell, "getOrDefault returns None: `None`, required, unset or 'unset: <what applies>'")
        elif cell != _shown(value):
            wrong[name] = (cell, _shown(value))
    assert not wrong, f"docs/estimator.md's default column against fit_params.DEFAULTS: {wrong}"


def test_the_seconds_an_unset_timeout_takes_are_its_setting_s():
    cells = _param_cells()
    fit_defaults = {"stall_timeout": settings.DEFAULT_FIT_STALL_TIMEOUT}  # a fit's, where the setting has none
    checked = []
    for name, cell in cells.items():
        m = re.fullmatch(r"unset: (\d+) s \(`(HVD_SPARK_\w+)`\)", cell)
        if not m:
            continue
        setting = next(s for s in vars(settings).values() if isinstance(s, settings.Setting) and s.env == m.group(2))
        assert setting.name == name, (name, setting.name)
        assert float(m.group(1)) == fit_defaults.get(name, setting.default), (name, cell, setting.default)
        checked.append(name)
    assert sorted(checked) == ["elastic_timeout", "stall_timeout", "start_timeout"]


def test_launcher_md_gives_run_s_signature():
    text = (ROOT / "docs" / "launcher.md").read_text()
    documented = re.search(r"^`(run\(fn,.*?\))`", text, re.S | re.M)
    assert documented, "docs/launcher.md has no `run(fn, ...)` signature"
    parts = []
    star = False
    for p in inspect.signature(hvd_spark.run).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    assert " ".join(documented.group(1).split()) == f"run({', '.join(parts)})"


_SETTERS = """
from hvd_spark._internal.ml.transformer import TFTransformer
print(" ".join(sorted(n for n in dir(TFTransformer) if re.match(r"set[A-Z]", n))))
"""


def test_the_fitted_transformer_s_setters_are_the_documented_ones():
    # pyspark.ml is loaded in a fresh interpreter: this tier's own process must not load it
    out = subprocess.run(
        [sys.executable, "-c", "import re" + _SETTERS], capture_output=True, text=True, timeout=300, check=True
    )
    actual = set(out.stdout.split())
    row = next(line for line in ESTIMATOR_MD.splitlines() if line.startswith("| setters and getters |"))
    documented = set(re.findall(r"`(set[A-Z]\w+)`", row.split("A fitted `TFTransformer`", 1)[1]))
    assert documented == actual, f"documented only: {documented - actual}; not documented: {actual - documented}"


def _horovod_keras_estimator_params() -> list[str]:
    spec = importlib.util.find_spec("horovod")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("horovod is not installed")
    source = pathlib.Path(list(spec.submodule_search_locations)[0]) / "spark" / "keras" / "estimator.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KerasEstimator")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]


def test_the_count_of_horovod_s_params_is_horovod_s():
    params = _horovod_keras_estimator_params()
    assert not set(params) - set(DEFAULTS), "every horovod.spark KerasEstimator param is a Param here"
    counts = re.findall(r"all (\d+) of its parameters", README) + re.findall(
        r"all (\d+) `KerasEstimator.__init__` params", ESTIMATOR_MD
    )
    assert counts == [str(len(params))] * 2, (counts, len(params))


def _readme_versions() -> dict[str, dict[str, str]]:
    """The README's table of the Spark lines: ``{first cell: {column: cell}}``."""
    lines = README.split("### Spark lines", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = {}
    for line in rows[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = dict(zip(header, cells))
    return table


def test_the_version_table_is_the_constraints_and_pyproject_s_ranges():
    table = _readme_versions()
    packages = ["pyspark", "pyarrow", "numpy", "pandas", "tensorflow-cpu"]
    for first, row in table.items():
        m = re.match(r"\**(\d\.\d)\**", first)
        if not m:
            continue
        pins = dict(
            line.split("==", 1)
            for line in (ROOT / "constraints" / f"spark-{m.group(1)}.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")
        )
        assert {p: row[p] for p in packages} == {p: pins[p] for p in packages}, first
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["spark"]
    requirements += project["optional-dependencies"]["cpu"]
    ranges = {}
    for r in requirements:
        name, spec = re.match(r"([\w-]+)(?:\[[^]]*\])?(.*)", r).groups()  # type: ignore[union-attr]
        ranges[name] = ",".join(sorted(spec.split(","), key=lambda part: part.lstrip("<>=!~")))
    accepted = table["what `pyproject.toml` accepts"]
    shown = {p: ",".join(sorted(accepted[p].split(","), key=lambda part: part.lstrip("<>=!~"))) for p in packages}
    assert shown == {p: ranges[p] for p in packages}


def test_the_install_commands_install_from_a_clone():
    """``pip install 'hvd_spark[cpu,spark]'`` finds no distribution: the first install is from a clone's
    folder (``.``); an extra added later by name (``pip install 'hvd_spark[s3]'``) is read from the
    installed hvd_spark."""
    install = (ROOT / "docs" / "install.md").read_text()
    matrix = install.split("## The install matrix", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"`(pip install [^`]*)`", matrix)
    assert commands and all(re.match(r"pip install '?\.", c) for c in commands), commands
    section = README.split("## Installing", 1)[1].split("\n## ", 1)[0]
    assert "pip install '.[cpu,spark]'" in section
    first_installs = re.compile(r"pip install '?hvd_spark(\[(cpu|gpu)[^\]]*\])?'?`")
    for name, text in (("README.md", README), ("docs/install.md", install)):
        assert not first_installs.findall(text), f"{name} installs hvd_spark from an index, where it is not"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = install.split("## The extras", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    assert {n for row in rows for n in re.findall(r"`([\w-]+)`", row)} == set(extras)
