"""benchmarks/bench_small_fits.py's pieces that decide its figures, without TF or Spark: a fit's phases
from the driver's step times, the ranks' marks and the fit summary (they add up to the fit's wall
time), the copy's parts, and the medians, ratios and targets written to results/small_fits.json."""

import importlib
import json
import os
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    return importlib.import_module("benchmarks.bench_small_fits")


def _clock(bench, calls, waits=()):
    clock = object.__new__(bench._StepClock)  # no wrapping: the library is not imported here
    clock.calls, clock.waits = list(calls), list(waits)
    return clock


def test_a_fits_phases_add_up_to_its_wall_time(bench, tmp_path):
    calls = [
        ("_launch_options", 100.1, 100.2),
        ("read_in_place", 100.5, 100.9),
        ("check", 100.05, 101.0),
        ("prepare", 101.1, 101.3),
        ("_write_attempt", 101.3, 103.0),
        ("_parquet_files", 102.8, 102.9),
        ("materialize", 101.05, 103.0),
        ("plan_ranks", 103.0, 103.1),
        ("train_with_restarts", 103.1, 106.0),
        ("verify_and_build", 106.0, 106.1),
        ("check", 200.0, 201.0),  # a later fit's: not this one's
    ]
    for rank in (0, 1):
        marks = {"train_end": 105.8}  # train_begin: 105.8 - train_seconds
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(marks))
    startup = {"process": 0.1, "horovod_init": 0.2, "model": 0.3, "data": 0.1, "first_step": 0.5, "warm": 1.0}
    summary = SimpleNamespace(
        ranks=[SimpleNamespace(rank=r, startup=startup, train_seconds=1.8) for r in (0, 1)],
        materialize_seconds=1.95,
        train_job_seconds=2.9,
        fit_seconds=6.2,
        steps_per_epoch=21,
    )
    out = bench.fit_phases(_clock(bench, calls, [(100.8, 0.3)]), 100.0, 106.2, summary, str(tmp_path))
    ph = out["phases_s"]
    assert sum(ph.values()) == pytest.approx(6.2)
    assert ph["run_plan_and_data_identity"] == pytest.approx(0.05)  # check's end to materialize's start
    assert ph["between_steps_unaccounted"] == pytest.approx(0.0)
    assert ph["data_copy"] == pytest.approx(1.95) and ph["first_step"] == pytest.approx(0.5)
    assert ph["launch_to_rank_task"] == pytest.approx(104.0 - 0.6 - 0.1 - 103.1)
    assert ph["final_model_and_job_end"] == pytest.approx(0.2) and ph["return"] == pytest.approx(0.1)
    assert out["driver_checks_s"] == pytest.approx(1.0) and out["checks_waited_for_executors_s"] == 0.3
    parts = out["copy_parts_s"]
    assert parts["spark_write_job"] == pytest.approx(1.6) and parts["wrote_a_copy"] is True
    assert out["warm_rank"] is True


def test_the_medians_ratios_and_targets(bench):
    def hvd(cold, warm, copy, process_to_cold):
        fit = {"fit_s": cold, "phases_s": {"data_copy": copy}, "copy_parts_s": {"spark_write_job": copy}}
        return {"cold_fit": fit, "warm_fit": {"fit_s": warm}, "process_to_cold_fit_end_s": process_to_cold}

    plain = [{"process_s": 4.0, "fit_s": 1.0}, {"process_s": 6.0, "fit_s": 1.2}, {"outcome": "failed"}]
    runs = [hvd(7.0, 2.5, 3.0, 15.0), hvd(5.0, 1.5, 0.5, 13.0)]
    out = bench.summarize(plain, runs, [{"whole_s": 20.0}], [{"wall_s": 28.0}])
    m = out["medians"]
    assert m["plain_process_s"] == 5.0 and m["cold_fit_s"] == 6.0 and m["warm_fit_s"] == 2.0
    assert m["cold_fit_over_plain_process"] == pytest.approx(1.2)
    assert m["cold_process_over_plain_process"] == pytest.approx(2.8)
    assert m["tuning_over_plain"] == pytest.approx(1.4)
    met = {t["target"].split(" ")[0]: t["met"] for t in out["targets"]}
    assert met == {"cold": True, "warm": True, "copy": False, "CrossValidator": True}
    untuned = bench.summarize(plain, runs, [], [])
    assert untuned["targets"][-1]["met"] is None and "not run" in untuned["targets"][-1]["note"]
    assert "| cold fit (first in the process) | 6.00 | 1.10 |" in bench.table(out)
