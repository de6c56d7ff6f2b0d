"""benchmarks/README.md's results table is made from the committed results files by ``python -m
benchmarks.run --report`` alone (issue 47.7: running a benchmark rewrote the tracked README, whose
table then differed from the committed results in 171 lines). No benchmark runs here."""

import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run(monkeypatch):
    """``benchmarks/run.py`` (a package at the repository's root, importable from any working folder)."""
    monkeypatch.syspath_prepend(ROOT)
    return importlib.import_module("benchmarks.run")


def test_the_readme_is_what_the_report_step_makes_of_the_committed_results(run):
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        text = f.read()
    expected = run.readme_with(run.report(), text)
    if text != expected:
        differing = [
            f"line {i + 1}: {a!r} != {b!r}"
            for i, (a, b) in enumerate(zip(text.splitlines(), expected.splitlines()))
            if a != b
        ]
        pytest.fail(
            f"benchmarks/README.md is not what `python -m benchmarks.run --report` makes of benchmarks/results/ "
            f"({len(differing)} lines differ; run it and commit the README). First: {differing[:3]}"
        )


def test_running_benchmarks_leaves_the_readme_to_the_report_step(run, tmp_path, monkeypatch):
    """``python -m benchmarks.run`` runs the scripts (each writes its own results file) and nothing else."""
    calls = []
    monkeypatch.setattr(run.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 0)
    monkeypatch.setattr(run, "README", str(tmp_path / "README.md"))  # a write would land here, not in the tree
    monkeypatch.setattr(run, "plots", lambda: calls.append("plots"))
    monkeypatch.setattr("sys.argv", ["run", "--only", "comm,ps"])
    run.main()
    assert [c[2] for c in calls] == ["benchmarks.bench_comm", "benchmarks.bench_ps"]
    assert not (tmp_path / "README.md").exists()
    (tmp_path / "README.md").write_text(f"intro\n{run.START}\nold\n{run.END}\nrest\n")
    monkeypatch.setattr("sys.argv", ["run", "--report"])
    run.main()
    assert calls[-1] == "plots" and len(calls) == 3  # --report runs no benchmark
    text = (tmp_path / "README.md").read_text()
    assert text.startswith(f"intro\n{run.START}\nMachine: ") and text.endswith(f"\n{run.END}\nrest\n")
