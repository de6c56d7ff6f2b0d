"""Runs the benchmark suite; rebuilds benchmarks/README.md's results from results/ in a separate step.

    .venv/bin/python -m benchmarks.run [--quick] [--only comm,ps,...]   # writes results/<name>.json only
    .venv/bin/python -m benchmarks.run --report                          # the README's table and the plots

Each benchmark runs in its own process (one SparkContext per process) and writes only its own
results file. ``--report`` rebuilds, from the results files alone, the table of benchmarks/README.md
between the RESULTS markers and the PNG plots; tests/fast/test_benchmarks_report.py checks that the
committed README is what ``--report`` makes of the committed results.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import RESULTS, mib

ORDER = [
    "comm",
    "ps",
    "scaling",
    "e2e",
    "data",
    "inference",
    "connect",
    "speed",
    "memory",
    "parity",
    "elastic",
    "inplace",
    "overhead",
    "vs_keras",
    "vs_torch",
]
ROOT_ONLY = ["multihost"]  # needs root (network namespaces): run with --only multihost
MODULES = {
    "multihost": "bench_multihost",
    "comm": "bench_comm",
    "ps": "bench_ps",
    "scaling": "bench_scaling",
    "e2e": "bench_e2e",
    "data": "bench_data",
    "inference": "bench_inference",
    "connect": "bench_connect",
    "speed": "bench_speed",
    "memory": "bench_memory",
    "parity": "bench_parity",
    "elastic": "bench_elastic",
    "inplace": "bench_inplace",
    "overhead": "bench_overhead",
    "vs_keras": "bench_vs_keras",
    "vs_torch": "bench_vs_torch",
}
FILES = {
    "multihost": "multihost",
    "comm": "comm",
    "ps": "ps_vs_allreduce",
    "scaling": "scaling",
    "e2e": "e2e_overhead",
    "data": "data_path",
    "inference": "inference",
    "connect": "connect",
    "speed": "speed",
    "memory": "memory",
    "parity": "parity",
    "elastic": "elastic",
    "inplace": "inplace",
    "overhead": "overhead",
    "vs_keras": "vs_keras",
    "vs_torch": "vs_torch",
}
HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    path = os.path.join(RESULTS, f"{FILES[name]}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _ok(flag):
    return "met" if flag else "**missed**"


def _stack(d) -> str:
    """The line naming the stack and date a section's figures come from."""
    e = d.get("environment", {})
    numpy = f", numpy {e['numpy']}" if "numpy" in e else ""
    return (
        f"_Run {e.get('date')}: Python {e.get('python')}, pyspark {e.get('pyspark')}, pyarrow "
        f"{e.get('pyarrow')}{numpy}._"
    )


def _table(lines, title, header, d) -> None:
    """Appends a section title, the section's stack line and a Markdown table header."""
    lines += [
        title,
        "",
        _stack(d),
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]


def report() -> str:
    comm, ps, scaling, e2e, data, inf = (_load(n) for n in ORDER[:6])  # connect, multihost: own sections
    if ps and comm and not ps.get("alpha_beta"):
        from benchmarks.bench_ps import alpha_beta

        ps["alpha_beta"] = alpha_beta(ps["rows"], comm)
    lines = []
    env = next((d["environment"] for d in (comm, ps, scaling, e2e, data, inf) if d), {})
    lines.append(
        f"Machine: {env.get('cpus')} cores, {env.get('memory_gib')} GiB, {env.get('machine')}; TF "
        f"{env.get('tensorflow-cpu')}, Horovod {env.get('horovod')}. Figures are medians; spread is min-max "
        "over the repeats. One intra-op thread per rank unless said. Each section names the stack and date "
        "of its own run (sections can be re-run alone with --only)."
    )
    lines.append("")
    if ps:
        lines += [
            "### 1. Ring-allreduce vs parameter server (step time per global step = one batch per worker)",
            "",
            _stack(ps),
            "",
        ]
        lines.append("| workers | gradient | allreduce s | PS s | PS / allreduce | alpha-beta predicted ratio | note |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        preds = {(p["workers"], p["bytes"]): p for p in (ps.get("alpha_beta") or {}).get("predictions", [])}
        for r in ps["rows"]:
            pr = preds.get((r["workers"], r["bytes"]))
            a, b = r["allreduce_step_s"], r["ps_step_s"]
            predicted = f"{pr['ratio']:.2f}" if pr else "-"
            note = (
                f"oversubscribed: {r['workers'] + 2} processes on {env.get('cpus', '?')} cores"
                if r.get("oversubscribed")
                else ""
            )
            lines.append(
                f"| {r['workers']} | {mib(r['bytes'])} | {a['median']:.4f} ({a['min']:.4f}-{a['max']:.4f}) | "
                f"{b['median']:.4f} ({b['min']:.4f}-{b['max']:.4f}) | {r['ratio_ps_over_allreduce']:.2f} | "
                f"{predicted} | {note} |"
            )
        t64 = [r for r in ps["rows"] if r["bytes"] == 64 << 20 and r["workers"] == 4]
        ge16 = [r for r in ps["rows"] if r["bytes"] >= 16 << 20]
        lines.append("")
        lines.append(f"Algorithms: allreduce = {ps['algorithms']['allreduce']}; PS = {ps['algorithms']['ps']}.")
        lines.append("")
        if t64:
            lines.append(
                f"- Target PS / allreduce >= 1.5 at 64 MiB, 4 workers: {t64[0]['ratio_ps_over_allreduce']:.2f}, "
                f"{_ok(t64[0]['ratio_ps_over_allreduce'] >= 1.5)}."
            )
        if ge16:
            lines.append(
                f"- Target allreduce never slower than PS at >= 16 MiB: "
                f"{_ok(all(r['ratio_ps_over_allreduce'] >= 1 for r in ge16))} "
                f"(lowest ratio {min(r['ratio_ps_over_allreduce'] for r in ge16):.2f})."
            )
        lines.append("")
    if comm:
        lines += [
            "### Communication: Horovod allreduce bus bandwidth (2 ranks, Gloo over loopback)",
            "",
            _stack(comm),
            "",
        ]
        tcp, mem = comm["loopback_tcp_Bps"]["median"], comm["memcpy_Bps"]["median"]
        lines.append(
            f"Loopback TCP, both directions at once: {tcp / 1e9:.2f} GB/s per direction; memcpy: "
            f"{mem / 1e9:.2f} GB/s (same run)."
        )
        lines.append("")
        lines.append("| size | time ms | busbw GB/s | busbw / loopback TCP | busbw / memcpy |")
        lines.append("| --- | --- | --- | --- | --- |")
        for r in comm["allreduce"]:
            lines.append(
                f"| {mib(r['bytes'])} | {r['time_s']['median'] * 1e3:.2f} | {r['busbw_Bps'] / 1e9:.3f} | "
                f"{r['busbw_over_tcp']:.2f} | {r['busbw_over_memcpy']:.3f} |"
            )
        big = [r for r in comm["allreduce"] if r["bytes"] >= 16 << 20]
        lines.append("")
        if big:
            worst = min(r["busbw_over_tcp"] for r in big)
            lines.append(
                f"- Target busbw >= 0.7 x loopback bandwidth at >= 16 MiB: lowest {worst:.2f}, {_ok(worst >= 0.7)}."
            )
        f = comm["fusion"]
        lines.append(
            f"- Tensor fusion, {f['tensors']} tensors of {f['bytes_each']} B: "
            f"{f['step_s']['on']['median'] * 1e3:.1f} ms per step with fusion, "
            f"{f['step_s']['off']['median'] * 1e3:.1f} ms without ({f['speedup_on_vs_off']:.2f}x)."
        )
        lines.append("")
    if scaling:
        _table(
            lines, "### 2. Scaling (compute-bound CNN, batch 64 per worker)", ["configuration", "samples/s"], scaling
        )
        for k, v in scaling["samples_per_s"].items():
            lines.append(f"| {k} | {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f}) |")
        lines.append("")
        lines.append(f"- E(2) = X(2) / (2 X(1)) = {scaling['E2']:.2f}: target >= 0.85 {_ok(scaling['E2'] >= 0.85)}.")
        lines.append("")
    if e2e:
        lines += ["### 3. End-to-end overhead (1 epoch, MLP, global batch 256)", "", _stack(e2e), ""]
        lines.append(
            "| rows | plain Keras s | workers | fit wall s | materialize s | launch + shutdown s | training s | "
            "checks s | fit / plain |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in e2e["rows"]:
            for n in (1, 2):
                f = r.get(f"fit_{n}w")
                if f:
                    lines.append(
                        f"| {r['rows']:,} | {r['plain_keras_fit_s']:.1f} | {n} | {f['wall_s']:.1f} | "
                        f"{f['materialize_s']:.1f} | {f['launch_and_shutdown_s']:.1f} | {f['training_s']:.1f} | "
                        f"{f['checks_s']:.1f} | {f['ratio_over_plain']:.2f} |"
                    )
        big = max(e2e["rows"], key=lambda r: r["rows"])
        lines.append("")
        lines.append(
            f"- Target 1-worker fit <= 1.5 x plain Keras at the largest size ({big['rows']:,} rows): "
            f"{big['fit_1w']['ratio_over_plain']:.2f}, {_ok(big['fit_1w']['ratio_over_plain'] <= 1.5)}."
        )
        fixed = max(r["fit_1w"]["launch_and_shutdown_s"] for r in e2e["rows"])
        lines.append(f"- Target fixed overhead (launch + shutdown) <= 10 s: at most {fixed:.1f} s, {_ok(fixed <= 10)}.")
        lines.append("")
    if data:
        lines += ["### 4. Data path (one rank, batches of 256)", "", _stack(data), ""]
        lines.append(
            f"- pyarrow iter_batches of 256 rows (the target's baseline): "
            f"{data['pyarrow_rows_per_s']['median']:,.0f} rows/s."
        )
        if "pyarrow_whole_file_rows_per_s" in data:
            lines.append(
                f"- pyarrow, each file read whole (no batching; serial, like iter_batches): "
                f"{data['pyarrow_whole_file_rows_per_s']['median']:,.0f} rows/s."
            )
        for reader, target in (("arrow", 0.8), ("petastorm", 0.5)):
            if f"{reader}_tfdata_rows_per_s" in data:
                ratio = data[f"ratio_{reader}_over_pyarrow"]
                lines.append(
                    f"- reader='{reader}' into tf.data: {data[f'{reader}_tfdata_rows_per_s']['median']:,.0f} "
                    f"rows/s; ratio {ratio:.2f}: target >= {target} {_ok(ratio >= target)}"
                    + (
                        f"; {data[f'ratio_{reader}_over_pyarrow_whole_file']:.2f}x the whole-file read. The reader "
                        "reads row groups in a prefetch thread while tf.data rebatches on the other "
                        "core, which is how it passes the serial baselines."
                        if f"ratio_{reader}_over_pyarrow_whole_file" in data
                        else "."
                    )
                )
        lines.append("")
    if inf:
        _table(lines, "### 5. Inference (local[2])", ["method", "rows/s"], inf)
        for b, v in inf["transform_rows_per_s_by_arrow_batch"].items():
            lines.append(f"| TFTransformer.transform, Arrow batch {int(b):,} | {v['median']:,.0f} |")
        for kind, v in (inf.get("transform_rows_per_s_by_udf_at_10000") or {}).items():
            lines.append(f"| TFTransformer.transform, {kind} UDF, Arrow batch 10,000 | {v['median']:,.0f} |")
        lines.append(f"| predict_batch_udf (batch 1024) | {inf['predict_batch_udf_rows_per_s']['median']:,.0f} |")
        lines.append(
            f"| single-process model.predict (in memory, TF default threads = 2) | "
            f"{inf['single_process_predict_rows_per_s']['median']:,.0f} |"
        )
        if "single_process_predict_1_thread_rows_per_s" in inf:
            lines.append(
                f"| single-process model.predict (in memory, 1 thread) | "
                f"{inf['single_process_predict_1_thread_rows_per_s']['median']:,.0f} |"
            )
        lines.append(f"| row-at-a-time mapPartitions | {inf['row_at_a_time_rows_per_s']['median']:,.0f} |")
        lines.append("")
        r1, r2 = inf["ratio_transform_over_single_predict"], inf["ratio_transform_over_row_at_a_time"]
        lines.append(
            f"- Target transform >= 1.5 x single-process predict: {r1:.2f}, {_ok(r1 >= 1.5)} (against the "
            "process using both cores); against a 1-thread process: "
            f"{inf.get('ratio_transform_over_single_predict_1_thread', float('nan')):.2f}."
        )
        lines.append(f"- Target transform >= 20 x row-at-a-time: {r2:.1f}, {_ok(r2 >= 20)}.")
        lines.append("")
    connect = _load("connect")
    if connect:
        _connect_section(lines, connect)
    speed = _load("speed")
    if speed:
        _speed_section(lines, speed, inf)
    parity = _load("parity")
    if parity:
        _parity_section(lines, parity)
    elastic = _load("elastic")
    if elastic:
        _elastic_section(lines, elastic)
    inplace = _load("inplace")
    if inplace:
        _inplace_section(lines, inplace)
    overhead = _load("overhead")
    if overhead:
        _overhead_section(lines, overhead)
    memory = _load("memory")
    if memory:
        _memory_section(lines, memory)
    vs_keras = _load("vs_keras")
    if vs_keras:
        _vs_keras_section(lines, vs_keras)
    vs_torch = _load("vs_torch")
    if vs_torch:
        _vs_torch_section(lines, vs_torch)
    multihost = _load("multihost")
    if multihost:
        _multihost_section(lines, multihost)
    return "\n".join(lines)


def _connect_section(lines, d) -> None:
    """Spark Connect against a classic session (bench_connect)."""
    _table(lines, "### Spark Connect against a classic session", ["session", "fit s", "transform s", "accuracy"], d)
    for side in ("classic", "connect"):
        f, t = d[side]["fit_s"], d[side]["transform_s"]
        lines.append(
            f"| {side} | {f['median']:.1f} ({f['min']:.1f}-{f['max']:.1f}) | {t['median']:.1f} "
            f"({t['min']:.1f}-{t['max']:.1f}) | {min(d[side]['accuracy']):.3f} |"
        )
    lines.append("")
    lines.append(
        f"- {d['what']}. Connect / classic: fit {d['ratio_fit_connect_over_classic']:.2f}, transform "
        f"{d['ratio_transform_connect_over_classic']:.2f}."
    )
    lines.append("")


def _parity_section(lines, d) -> None:
    """Held-out accuracy of 2 ranks against one process with the same global batch (bench_parity, issue 24)."""
    header = [
        "model",
        "plain Keras, batch 64",
        "hvd_spark 2 x 32",
        "hvd_spark 1 x 64",
        "gap (plain - 2 ranks)",
        "max gap",
    ]
    _table(lines, "### Accuracy parity: 2 ranks against one process", header, d)
    for kind, m in d["models"].items():
        lines.append(
            f"| {kind} | {m['plain_mean']:.4f} | {m['hvd_spark_mean']:.4f} "
            f"| {m.get('hvd_spark_1rank_mean', float('nan')):.4f} "
            f"| {m['gap_mean'] * 100:+.2f} pt | {m['gap_max'] * 100:+.2f} pt |"
        )
    lines.append("")
    lines.append(
        f"- digits, {d['epochs']} epochs, Adam 1e-3, the same initial weights and steps; means over seeds "
        f"{d['seeds']}; per-seed figures in results/parity.json."
    )
    lines.append("")


def _elastic_section(lines, d) -> None:
    """Recovery from a killed executor: elastic continuation against a restart from the epoch (bench_elastic)."""
    header = ["mode", "ranks after", "failure -> next first step (s)", "steps redone", "work lost (s)", "fit (s)"]
    _table(lines, "### Recovery from a killed executor", header, d)
    for mode, m in d["modes"].items():
        rec = m.get("recovery") or {}
        lost = m.get("work_lost_s")
        lines.append(
            f"| {mode} | {rec.get('to_size', '?')} | {m.get('recover_s') or float('nan'):.1f} "
            f"| {m.get('steps_redone')} | {lost if lost is not None else float('nan'):.1f} | {m['fit_s']:.1f} |"
        )
    lines.append("")
    ratios = ", ".join(f"{k[len('ratio_') :]} {v:.2f}" for k, v in d.items() if k.startswith("ratio_"))
    lines.append(
        f"- local-cluster with 3 executors, {d['rows']} rows, {d['epochs']} epochs; one executor killed (SIGKILL) "
        f"20 steps into epoch 2. Elastic / restart: {ratios or 'n/a'}."
    )
    lines.append("")


def _inplace_section(lines, d) -> None:
    """A fit on a Parquet table: copied to the store vs read in place (bench_inplace)."""
    header = ["rows", "path", "first step (s)", "fit (s)", "data step (s)", "store after", "table"]
    _table(lines, "### A Parquet table: copied vs read in place", header, d)
    for rows, t in d["tables"].items():
        for name, m in t["modes"].items():
            lines.append(
                f"| {int(rows):,} | {name.replace('_', ' ')} | {m['first_step_s']:.1f} | {m['fit_s']:.1f} "
                f"| {m['data_s']:.1f} | {mib(m['store_bytes'])} | {mib(t['table_bytes'])} |"
            )
    lines.append("")
    for rows, t in d["tables"].items():
        lines.append(
            f"- {int(rows):,} rows, in place / copy: first step {t['ratio_first_step']:.2f}, fit "
            f"{t['ratio_fit']:.2f}, store bytes {t['ratio_store_bytes']:.2f}."
        )
    lines.append(
        f"- {d['ranks']} ranks on local[2], {d['epochs']} epoch, batch {d['batch_size']} per rank, 16 float features "
        "(an array column) and a label; each fit on a fresh store."
    )
    lines.append("")


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _med(stats_or_none, key):
    return ((stats_or_none or {}).get(key) or {}).get("median")


def _overhead_section(lines, d) -> None:
    """Launchers side by side on one job: first step, whole job, overhead, transform, a killed rank."""
    header = [
        "system",
        "fit",
        "first step (s)",
        "whole job (s)",
        "training (s)",
        "overhead (s)",
        "transform (s)",
        "process (s)",
    ]
    order = ["hvd_spark", "plain Keras", "horovod.spark KerasEstimator", "horovod.run (Gloo, no Spark)"]
    systems = dict(sorted((d.get("systems") or {}).items(), key=lambda kv: (order + [kv[0]]).index(kv[0])))
    if systems:
        _table(lines, "### Launcher overhead: the same MLP job under each launcher (issue 28)", header, d)
    else:
        lines += ["### Launcher overhead: the same MLP job under each launcher (issue 28)", "", _stack(d), ""]
    for name, entry in systems.items():
        if "skipped" in entry:
            lines.append(f"| {name} | - | skipped: {entry['skipped']} | | | | | |")
            continue
        runs = entry.get("runs", [])
        failed = [run["cold"] for run in runs if run["cold"].get("outcome") != "finished"]
        if failed:
            lines.append(
                f"| {name} | cold | failed in {len(failed)} of {len(runs)} runs: {str(failed[0].get('error'))[:80]} "
                "| | | | | |"
            )
        for phase in ("cold", "warm"):
            f = entry.get(phase)
            if not f:
                continue
            lines.append(
                f"| {name} | {phase} | {_fmt(_med(f, 'first_step_s'))} | {_fmt(_med(f, 'whole_s'))} "
                f"| {_fmt(_med(f, 'training_s'))} | {_fmt(_med(f, 'overhead_s'))} "
                f"| {_fmt(_med(f, 'transform_s'), '.2f')} "
                f"| {_fmt(_med(f, 'process_wall_s')) if phase == 'cold' else ''} |"
            )
    lines.append("")
    t = d.get("targets", {})
    m = t.get("measured", {})
    if m:
        warm = m.get("hvd_spark_warm_fit_s")
        cold, transform = (
            m.get("cold_fit_horovod_spark_over_hvd_spark"),
            m.get("cold_transform_horovod_spark_over_hvd_spark"),
        )
        lines.append(
            f"- Targets: warm fit {_fmt(warm, '.2f')} s (<= {t['warm_fit_s_at_most']:g} s: "
            f"{_ok((warm or 99) <= t['warm_fit_s_at_most'])}); cold fit, horovod.spark / hvd_spark "
            f"{_fmt(cold, '.2f')} (>= {t['cold_fit_ratio_at_least']:g}: "
            f"{_ok((cold or 0) >= t['cold_fit_ratio_at_least'])}); "
            f"cold transform, horovod.spark / hvd_spark {_fmt(transform, '.2f')} (>= "
            f"{t['cold_transform_ratio_at_least']:g}: {_ok((transform or 0) >= t['cold_transform_ratio_at_least'])})."
        )
    kill = d.get("kill_rank_1_after_epoch_2") or {}
    for name, k in kill.items():
        if "skipped" in k:
            continue
        what = f"{k.get('outcome')}"
        if k.get("outcome") == "finished":
            what += f" after {k.get('restarts')} restart(s), {_fmt(k.get('kill_to_end_s'))} s from the kill to the end"
            if k.get("kill_to_training_again_s") is not None:
                what += f" (training again {_fmt(k.get('kill_to_training_again_s'))} s after the kill)"
        else:
            what += f" {_fmt(k.get('kill_to_end_s'))} s after the kill: {str(k.get('error'))[:120].rstrip('.:')}"
        lines.append(f"- Rank 1 killed after epoch 2, {name}: {what}.")
    steps = d.get("step_cost_ms") or {}
    if steps:
        parts = [f"{label} {_fmt(v.get('median'), '.2f')}" for label, v in steps.get("hvd_spark_2_ranks", {}).items()]
        plain = [
            f"{label} {_fmt(v.get('median'), '.2f')}" for label, v in steps.get("plain_keras_1_process", {}).items()
        ]
        lines.append(
            "- Step cost (ms; rank 0, batch 1 to the last batch of epochs 2-10; 2 ranks on 2 cores): "
            f"{'; '.join(parts)}. "
            f"Plain Keras, one process: {'; '.join(plain)}."
        )
    stacks = [
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in entry["versions"].items())
        for name, entry in systems.items()
        if entry.get("versions")
    ]
    if stacks:
        lines.append(f"- Other stacks (each in its own venv, `benchmarks/baselines/setup.sh`): {'; '.join(stacks)}.")
    lines.append(
        f"- {d.get('what', '')}; medians of {d.get('repeats')} runs of each system (taken in turn), step costs "
        f"of {d.get('step_repeats', d.get('repeats'))}; times from the launcher call (`fit`, `horovod.run`, "
        "`TorchDistributor.run`); training = rank 0's first step to its last; plain Keras: `model.fit` in a "
        "fresh process. Process: the script's wall time from outside (interpreter start, imports, session, "
        "both fits for the Spark estimators)."
    )
    lines.append("")


def _vs_keras_section(lines, d) -> None:
    """hvd_spark against plain Keras on the same cores, rows and steps (bench_vs_keras, issue 38)."""
    header = [
        "N",
        "B",
        "system",
        "whole job s",
        "fit s",
        "training rows/s",
        "step ms",
        "final loss",
        "tail s",
        "whole / plain",
        "rows/s / plain",
    ]
    title = "### hvd_spark against plain Keras (same cores, rows and steps)"
    if d.get("quick"):
        title += " (--quick: a smoke test, not the protocol's sizes)"
    _table(lines, title, header, d)
    names = {
        "plain": "plain Keras, batch 2B",
        "hvd_2ranks": "hvd_spark, 2 ranks x B",
        "hvd_default": "hvd_spark, default",
    }
    for e in d["grid"]:
        for system, med in e["medians"].items():
            ranks = {r.get("ranks") for r in e["runs"][system] if r.get("ranks")}
            name = names.get(system, system) + (f" ({'/'.join(map(str, sorted(ranks)))} rank(s))" if ranks else "")
            ratio = e["ratios"].get(system, {})
            cells = [_med(med, k) for k in ("whole_s", "fit_s", "train_rows_per_s", "step_ms", "final_loss", "tail_s")]
            specs = (".1f", ".1f", ",.0f", ".2f", ".4f", ".2f")
            row = [_fmt(v, spec) for v, spec in zip(cells, specs)]
            row += [_fmt(ratio.get(k), ".2f") for k in ("whole_over_plain", "train_rows_per_s_over_plain")]
            lines.append(f"| {e['rows']:,} | {e['batch_per_rank']} | {name} | " + " | ".join(row) + " |")
    lines.append("")
    mem = (d.get("memory") or {}).get("sizes") or {}
    if mem:
        lines.append(
            "| memory run: N | path | outcome | fit s | driver JVM MiB | driver Python MiB | ranks MiB (peak) |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for n, entry in sorted(mem.items(), key=lambda kv: int(kv[0])):
            if "skipped" in entry:
                lines.append(f"| {int(n):,} | - | skipped: {entry['skipped']} | | | | |")
                continue
            for path, r in entry.items():
                peak = r.get("peak_rss") or {}
                rank_mib = ", ".join(
                    f"{(v or 0) / (1 << 20):.0f}" for _, v in sorted((peak.get("ranks") or {}).items())
                )
                jvm, py = peak.get("driver_jvm"), peak.get("driver_python")
                lines.append(
                    f"| {int(n):,} | {path.replace('_', ' ')} | {r.get('outcome')} | {_fmt(r.get('fit_s'))} | "
                    f"{_fmt(jvm and jvm / (1 << 20), '.0f')} | {_fmt(py and py / (1 << 20), '.0f')} | "
                    f"{rank_mib or '-'} |"
                )
        lines.append("")
    for t in d.get("targets", []):
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        state = "not measured" if t["met"] is None else _ok(t["met"])
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"- Target {t['target']} {'<=' if t['at_most'] else '>='} {t['limit']:g}: {value}, {state}{note}.")
    lines.append(
        f"- {d.get('what', '')}; medians of {d.get('repeats')} run(s); tail = rank 0's last `on_epoch_end` to `fit` "
        "returning in the driver. Per-run figures (the driver's 'ranks finished' line, each rank's exit from "
        "training, peak RSS per process, start-up phases) in results/vs_keras.json."
    )
    lines.append("")


VS_TORCH_NAMES = {
    "plain": "plain torch, 1 process",
    "hvd_1rank": "TorchEstimator, num_proc=1",
    "hvd_2ranks": "TorchEstimator, num_proc=2",
    "run": "hvd_spark.run(train_fn)",
    "td_tasks": "TorchDistributor(local_mode=False)(train_fn)",
    "td_local": "TorchDistributor(local_mode=True)(train_fn)",
}


def _vs_torch_section(lines, d) -> None:
    """hvd_spark against plain torch and TorchDistributor on the same cores and rows (bench_vs_torch, issue 48)."""
    header = [
        "system",
        "ranks x batch",
        "whole job s",
        "fit / launcher call s",
        "training s",
        "training rows/s",
        "rows/s / plain",
        "rows/s / plain's read + training",
        "whole / plain",
        "outside the function s",
        "epoch loss",
    ]
    title = (
        f"### hvd_spark against plain torch and TorchDistributor ({d['rows']:,} rows, global batch {d['global_batch']})"
    )
    if d.get("quick"):
        title += " (--quick: a smoke test)"
    _table(lines, title, header, d)
    order = list(VS_TORCH_NAMES)
    for system, med in sorted(d["medians"].items(), key=lambda kv: (order + [kv[0]]).index(kv[0])):
        runs = [r for r in d["runs"][system] if r.get("outcome") == "ok"]
        ranks = runs[0].get("ranks", 1) if runs else 1
        per_rank = runs[0].get("batch_per_rank", d["global_batch"]) if runs else "-"
        ratio = d["ratios"].get(system, {})
        failed = med["runs"] - med["runs_ok"]
        name = VS_TORCH_NAMES.get(system, system) + (f" ({failed} of {med['runs']} runs failed)" if failed else "")
        fit = None if system == "plain" else _med({"w": med.get("work_s")}, "w")
        cells = [
            _fmt(_med(med, "whole_s")),
            _fmt(fit),
            _fmt(_med(med, "train_s")),
            _fmt(_med(med, "train_rows_per_s"), ",.0f"),
            _fmt(ratio.get("train_rows_per_s_over_plain"), ".2f") if system != "plain" else "1",
            _fmt(ratio.get("read_train_rows_per_s_over_plain"), ".2f") if system != "plain" else "1",
            _fmt(ratio.get("whole_over_plain"), ".2f") if system != "plain" else "1",
            _fmt(_med(med, "launcher_overhead_s")),
            _fmt(_med(med, "final_loss"), ".4f"),
        ]
        lines.append(f"| {name} | {ranks} x {per_rank} | " + " | ".join(cells) + " |")
    lines.append("")
    for t in d.get("targets", []):
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        state = "not measured" if t["met"] is None else _ok(t["met"])
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"- Target {t['target']} >= {t['limit']:g}: {value}, {state}{note}.")
    for system in ("td_tasks", "td_local"):
        r = d["ratios"].get(system)
        if not r:
            continue
        lines.append(
            f"- {VS_TORCH_NAMES[system]} / hvd_spark.run, the same function: whole job "
            f"{_fmt(r.get('whole_s_over_run'), '.2f')}, launcher call {_fmt(r.get('work_s_over_run'), '.2f')}, time "
            f"outside the function {_fmt(r.get('launcher_overhead_s_over_run'), '.2f')} "
            f"({_fmt(_med(d['medians'][system], 'launcher_overhead_s'))} s against "
            f"{_fmt(_med(d['medians'].get('run'), 'launcher_overhead_s'))} s), training rows/s "
            f"{_fmt(r.get('train_rows_per_s_over_run'), '.2f')}."
        )
    lines.append(
        f"- {d.get('what', '')}; medians of {d.get('repeats')} run(s). Training: plain torch's loop; TorchEstimator's "
        "ranks' `train_seconds` (the fit summary: the loop, reading the table in place as it goes, and the epoch's "
        "checkpoint); the function's first step to its last rank's end of training. Plain torch and the function "
        'read their rows before training: "read + training" counts that read in their time, as the estimator\'s '
        "ranks do. Outside the function: the launcher call to the first rank entering it, plus its last rank "
        "leaving it to the call returning. Per-run figures (reading, the process group's start, start-up phases) in "
        "results/vs_torch.json." + (f" {d['note']}" if d.get("note") else "")
    )
    lines.append("")


def _memory_section(lines, d) -> None:
    """RSS over a long fit against plain Keras (bench_memory, issue 14 item 7)."""
    header = [
        "process",
        "RSS after epoch 1 MiB",
        f"after epoch {d['warm_epoch']}",
        "last",
        "max",
        "growth",
        "MiB/epoch",
    ]
    _table(lines, "### Memory over a long run", header, d)
    rows = [("plain Keras, same rows and epochs (baseline)", d["plain_keras"])]
    rows += [(f"rank {r}", g) for r, g in sorted(d["ranks"].items())]
    rows += [("driver: Python", d["driver_python"]), ("driver: its JVM (Spark's)", d["driver_jvm"])]
    for name, g in rows:
        lines.append(
            f"| {name} | {g['first_mib']:.0f} | {g['at_warm_mib']:.0f} | {g['last_mib']:.0f} | {g['max_mib']:.0f} | "
            f"{g['growth_mib']:+.1f} | {g['slope_mib_per_epoch']:+.2f} |"
        )
    lines.append("")
    lines.append(
        f"- {d['what']}; fit {d['fit_s']:.0f} s. Growth counts from the end of epoch {d['warm_epoch']} to the "
        "last; per-epoch figures in results/memory.json."
    )
    lines.append(
        f"- Target ranks flat (growth at most plain Keras' + 16 MiB): {d['rank_growth_over_plain_mib']:+.1f} MiB "
        f"over plain, {_ok(d['target_ranks_flat'])}. Target driver flat (Python process, at most 16 MiB): "
        f"{d['driver_python']['growth_mib']:+.1f} MiB, {_ok(d['target_driver_flat'])}."
    )
    lines.append("")


def _speed_section(lines, d, inf) -> None:
    """The fixed cost of a fit, warm ranks and cheap steps (bench_speed, issue 13)."""

    def cell(x) -> str:
        return f"{x['median']:.1f} ({x['min']:.1f}-{x['max']:.1f})"

    g, big, tvs = d["digits"], d["million_rows"], d["train_validation_split"]
    _table(lines, "### Speed: the fixed cost of a fit, warm ranks, cheap steps", ["run", "seconds", "ratio"], d)
    plain = g["plain_fresh_process_s"]["median"]
    rows = [
        ("digits: plain Keras, fresh process (start + import + fit)", g["plain_fresh_process_s"], 1.0),
        ("digits: cold fit (no warm server)", g["cold_fit_s"], g["ratio_cold_over_plain"]),
        ("digits: second fit, warm ranks", g["warm_second_fit_s"], g["ratio_warm_second_over_plain"]),
        ("digits: second fit, warm ranks off", g["fresh_second_fit_s"], g["fresh_second_fit_s"]["median"] / plain),
    ]
    bplain = big["plain_fresh_process_s"]["median"]
    rows += [
        ("1M rows: plain Keras, fresh process (1 thread)", big["plain_fresh_process_s"], 1.0),
        ("1M rows: 1 worker, cold", big["cold_1w_s"], big["ratio_cold_1w_over_plain"]),
        ("1M rows: 1 worker, warm", big["warm_1w_s"], big["ratio_warm_1w_over_plain"]),
        ("1M rows: 2 workers, warm", big["warm_2w_s"], big["warm_2w_s"]["median"] / bplain),
        (
            "1M rows: 2 workers, warm, backward_passes_per_step=8",
            big["warm_2w_acc8_s"],
            big["warm_2w_acc8_s"]["median"] / bplain,
        ),
    ]
    for name, x, ratio in rows:
        lines.append(f"| {name} | {cell(x)} | {ratio:.2f} |")
    for label in ("cold", "warm"):
        t = tvs[label]
        state = "off" if label == "cold" else "on"
        lines.append(f"| TrainValidationSplit, {t['fits']} fits, warm ranks {state} | {t['wall_s']:.1f} | |")
    lines.append("")
    lines.append(f"- {d['what']}. Ratios: against the plain Keras row of the same block.")
    targets = [
        ("cold digits fit <= 1.3 x plain Keras", g["ratio_cold_over_plain"], g["ratio_cold_over_plain"] <= 1.3),
        ("warm second fit <= 3 s", g["warm_second_fit_s"]["median"], g["warm_second_fit_s"]["median"] <= 3.0),
        (
            "1M-row 1-worker fit <= 1.3 x plain Keras (cold)",
            big["ratio_cold_1w_over_plain"],
            big["ratio_cold_1w_over_plain"] <= 1.3,
        ),
        (
            "2 workers no slower than 1 with accumulation",
            big["ratio_2w_acc8_over_1w"],
            big["ratio_2w_acc8_over_1w"] <= 1.0,
        ),
    ]
    if inf and inf.get("ratio_transform_over_single_predict") is not None:
        r = inf["ratio_transform_over_single_predict"]
        targets.append(("transform >= 1.0 x single-process predict (inference section)", r, r >= 1.0))
    for text, value, ok in targets:
        lines.append(f"- Target {text}: {value:.2f}, {'met' if ok else '**missed**'}.")
    lines.append(
        f"- 2 workers / 1 worker without accumulation: {big['ratio_2w_over_1w']:.2f}; TrainValidationSplit "
        f"warm ranks off / on: {tvs['ratio_cold_over_warm']:.2f} (best validation accuracy "
        f"{tvs['cold']['best_accuracy']:.3f} / {tvs['warm']['best_accuracy']:.3f})."
    )
    cyc = ", ".join(
        f"{r['cycle_time_ms']}: {r['ms_per_allreduce']:.2f} / {r['ms_per_train_step']:.2f}"
        for r in d["allreduce_vs_cycle_time"]
    )
    lines.append(
        f"- HOROVOD_CYCLE_TIME (ms) against ms per 9.6 KB grouped allreduce / ms per training step of a "
        f"9 KB-gradient MLP, 2 ranks: {cyc}."
    )
    lines.append("")


def _multihost_section(lines, d) -> None:
    """Section 6: across network-namespace hosts with shaped links (bench_multihost)."""
    net = d["network"]
    lines += ["### 6. Across hosts (network namespaces, shaped links)", "", _stack(d), ""]
    lines.append(f"Links: {net['qdisc']}; added delay: {net['added_delay']}. Shared: {d['what_is_shared']}")
    lines.append("")
    lines.append("| hosts | message | allreduce s | busbw MB/s | alpha-beta busbw MB/s | measured / predicted |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for n, res in sorted(d["results"].items()):
        for r in res["allreduce"]:
            t = r["time_s"]
            lines.append(
                f"| {n} | {mib(r['bytes'])} | {t['median']:.4f} ({t['min']:.4f}-{t['max']:.4f}) | "
                f"{r['busbw_Bps'] / 1e6:.1f} | {r['predicted_busbw_Bps'] / 1e6:.1f} | "
                f"{r['measured_over_predicted_busbw']:.2f} |"
            )
    lines.append("")
    for n, res in sorted(d["results"].items()):
        lines.append(
            f"- {n} hosts: link {res['link_Bps'] / 1e6:.1f} MB/s (one TCP stream host to host), alpha "
            f"{res['alpha_s'] * 1e6:.0f} us (from the 4 KiB allreduce)."
        )
        if "scaling" in res:
            sc = res["scaling"]
            lines.append(
                f"- Scaling, CNN one rank per host: {sc['samples_per_s_1_rank']:.0f} samples/s on 1 rank, "
                f"{sc[f'samples_per_s_{n}_ranks']:.0f} on {n}: E({n}) = {sc[f'E{n}']:.2f}."
            )
    big = [
        r["measured_over_predicted_busbw"]
        for res in d["results"].values()
        for r in res["allreduce"]
        if r["bytes"] >= 4 << 20
    ]
    lines.append(
        f"- Reading: from 4 MiB up the ring reaches {min(big):.2f}-{max(big):.2f} of its alpha-beta busbw. The 4 KiB "
        "row defines alpha (ratio 1 by construction); that alpha is Horovod's negotiation cycle (milliseconds), "
        "not the wire (tens of microseconds), so the 256 KiB row beats its prediction."
    )
    ps_rows = [r for res in d["results"].values() for r in res.get("ps", [])]
    if ps_rows:
        drv = [r["sparkflow_hogwild_step_s"] / r["predicted_driver_ps_s"] for r in ps_rows if r["bytes"] >= 16 << 20]
        lines.append(
            f"- Parameter servers (same linear model as section 1, one worker per host): the driver-hosted PS "
            f"(SparkFlow design) runs at {min(drv):.2f}-{max(drv):.2f} of its prediction from 16 MiB up: every pull "
            "leaves through the driver's one link, so the model predicts it falls further behind the ring with each "
            "worker added. Hogwild and "
            "locked differ little here: two workers rarely collide, and the link, not the lock, is the limit."
        )
        lines.append("")
        lines.append(
            "| workers | gradient | allreduce s | driver PS hogwild s | driver PS locked s | TF PS s | "
            "predicted: allreduce / driver PS / TF PS s |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in ps_rows:
            tf_ps = r.get("tf_ps_step_s", {}).get("median")
            tf_cell = "-" if tf_ps is None else f"{tf_ps:.4f} ({r['tf_ps_over_allreduce']:.2f}x)"
            keys = ("predicted_allreduce_s", "predicted_driver_ps_s", "predicted_tf_ps_s")
            predicted = " / ".join(f"{r[k]:.4f}" for k in keys)
            lines.append(
                f"| {r['workers']} | {mib(r['bytes'])} | {r['allreduce_step_s']['median']:.4f} | "
                f"{r['sparkflow_hogwild_step_s']:.4f} ({r['sparkflow_hogwild_over_allreduce']:.2f}x) | "
                f"{r['sparkflow_locked_step_s']:.4f} ({r['sparkflow_locked_over_allreduce']:.2f}x) | "
                f"{tf_cell} | {predicted} |"
            )
    lines.append("")


def plots() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comm, ps = _load("comm"), _load("ps")
    if comm:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["bytes"] for r in comm["allreduce"]]
        ax.plot(xs, [r["busbw_Bps"] / 1e9 for r in comm["allreduce"]], "o-", label="Horovod allreduce busbw (2 ranks)")
        ax.axhline(comm["loopback_tcp_Bps"]["median"] / 1e9, color="gray", ls="--", label="loopback TCP, per direction")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.legend()
        ax.set_title("Allreduce bus bandwidth over Gloo")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "comm_busbw.png"), dpi=100)
        plt.close(fig)
    if ps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in sorted({r["workers"] for r in ps["rows"]}):
            rows = [r for r in ps["rows"] if r["workers"] == n]
            ax.plot(
                [r["bytes"] >> 20 for r in rows],
                [r["ratio_ps_over_allreduce"] for r in rows],
                "o-",
                label=f"{n} workers",
            )
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("gradient size (MiB)")
        ax.set_ylabel("PS step time / allreduce step time")
        ax.legend()
        ax.set_title("Parameter server vs ring-allreduce")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "ps_vs_allreduce.png"), dpi=100)
        plt.close(fig)


START, END = "<!-- RESULTS START -->", "<!-- RESULTS END -->"
README = os.path.join(HERE, "README.md")


def readme_with(table: str, text: str) -> str:
    """``text`` (benchmarks/README.md) with ``table`` between the RESULTS markers."""
    if START not in text or END not in text:
        raise ValueError(f"benchmarks/README.md has no {START} ... {END} markers to put the results between")
    return text[: text.index(START) + len(START)] + "\n" + table + "\n" + text[text.index(END) :]


def write_report() -> str:
    """The ``--report`` step: the README's table and the plots, from results/ alone. Returns the table."""
    table = report()
    with open(README) as f:
        text = f.read()
    with open(README, "w") as f:
        f.write(readme_with(table, text))
    try:
        plots()
    except ModuleNotFoundError as e:  # matplotlib: the bench extra
        print(f"plots not redrawn ({e}): pip install '.[bench]'", file=sys.stderr)
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a few minutes)")
    p.add_argument(
        "--only", default=",".join(ORDER), help=f"comma-separated subset of {ORDER + ROOT_ONLY} (default: {ORDER})"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: rebuild README.md's results table and the plots from results/",
    )
    a = p.parse_args()
    if a.report:
        print(write_report())
        return
    root = os.path.dirname(HERE)
    for name in [n for n in ORDER + ROOT_ONLY if n in a.only.split(",")]:
        t0 = time.time()
        cmd = [sys.executable, "-m", f"benchmarks.{MODULES[name]}"] + (["--quick"] if a.quick else [])
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd, cwd=root)
        print(f"== {name}: exit {rc} in {time.time() - t0:.0f}s", flush=True)
    print("results written to benchmarks/results/; python -m benchmarks.run --report rebuilds README.md from them")


if __name__ == "__main__":
    main()
