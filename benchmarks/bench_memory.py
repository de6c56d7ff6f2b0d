"""Memory over a long run (issue 14, item 7): the resident memory (RSS) of the driver and of each
rank at the end of every epoch of a 50-epoch fit (2 ranks, checkpoints every epoch), against plain
Keras training the same model on the same rows for 50 epochs in a fresh process, run side by side
in this script.

Growth is measured from the end of epoch 5 (allocators and tf.function caches warmed up) to the
last epoch, in MiB, with the slope of a least-squares line over those epochs.

    python -m benchmarks.bench_memory [--quick]
"""

import json
import os
import sys
import tempfile
import threading
import time

import cloudpickle
import keras
import numpy as np

from benchmarks.bench_e2e import _data, _model
from benchmarks.common import cli, session, write

cloudpickle.register_pickle_by_value(sys.modules[__name__])

WARM_EPOCH = 5  # growth counts from the end of this epoch
BATCH = 256
MIB = 1 << 20


class RssPerEpoch(keras.callbacks.Callback):
    """Appends ``{"epoch", "time", "rss"}`` of this process to ``<folder>/<who>.jsonl`` after each epoch."""

    def __init__(self, folder: str, who: str | None = None):
        super().__init__()
        self.folder, self.who = folder, who

    def on_epoch_end(self, epoch, logs=None):
        import psutil

        who = self.who or f"rank-{os.environ.get('HVD_SPARK_RANK', '0')}"
        with open(os.path.join(self.folder, f"{who}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": epoch + 1, "time": time.time(), "rss": psutil.Process().memory_info().rss}))
            f.write("\n")


def plain_keras(rows: int, epochs: int, folder: str) -> None:
    """The baseline, in a fresh process with 1 thread: plain model.fit on the same rows, in memory."""
    x, y = _data(rows)
    m = _model()
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
    m.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[RssPerEpoch(folder, "plain")])


class DriverSampler:
    """Samples the driver's RSS (its Python process, and its JVM) every ``interval`` seconds."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self.me = psutil.Process()
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _jvm_rss(self) -> int:
        import psutil

        total = 0
        for p in self.me.children(recursive=True):
            try:
                if p.name() == "java":
                    total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.samples.append((time.time(), self.me.memory_info().rss, self._jvm_rss()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> tuple[int, int]:
        """The last sample at or before ``t`` (python RSS, JVM RSS)."""
        before = [s for s in self.samples if s[0] <= t] or self.samples[:1]
        return before[-1][1], before[-1][2]


def _read(folder: str, who: str) -> list[dict]:
    with open(os.path.join(folder, f"{who}.jsonl")) as f:
        return sorted((json.loads(line) for line in f), key=lambda r: r["epoch"])


def _growth(series: list[int]) -> dict:
    """MiB from the end of epoch WARM_EPOCH to the last, the least-squares slope (MiB/epoch), and the range."""
    tail = np.asarray(series[WARM_EPOCH - 1 :], dtype=float) / MIB
    slope = float(np.polyfit(np.arange(len(tail)), tail, 1)[0]) if len(tail) > 1 else 0.0
    return {
        "first_mib": series[0] / MIB,
        "at_warm_mib": float(tail[0]),
        "last_mib": float(tail[-1]),
        "max_mib": max(series) / MIB,
        "growth_mib": float(tail[-1] - tail[0]),
        "slope_mib_per_epoch": slope,
        "per_epoch_mib": [round(v / MIB, 1) for v in series],
    }


def main(quick: bool):
    import pandas as pd

    import hvd_spark
    from hvd_spark import HorovodEstimator

    rows, epochs = (10_000, 12) if quick else (50_000, 50)
    spark = session("local[2]", spark_driver_memory="2g")
    try:
        with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as store:
            hvd_spark.run(plain_keras, args=(rows, epochs, folder), num_proc=1, num_threads=1, verbose=0, warm=False)
            x, y = _data(rows)
            df = spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y}), "x array<float>, y long")
            df = df.repartition(4).cache()
            df.count()
            est = HorovodEstimator(
                num_proc=2,
                store=store,
                model=_model(),
                optimizer=keras.optimizers.SGD(0.05),
                loss="binary_crossentropy",
                feature_cols=["x"],
                label_cols=["y"],
                batch_size=BATCH,
                epochs=epochs,
                callbacks=[RssPerEpoch(folder)],
                verbose=0,
            )
            t0 = time.perf_counter()
            with DriverSampler() as sampler:
                est.fit(df)
            fit_s = time.perf_counter() - t0
            plain = _read(folder, "plain")
            ranks = {r: _read(folder, f"rank-{r}") for r in (0, 1)}
            ends = [e["time"] for e in ranks[0]]
            driver_py = [sampler.at(t)[0] for t in ends]
            driver_jvm = [sampler.at(t)[1] for t in ends]
    finally:
        spark.stop()
    out = {
        "what": f"{rows:,} rows, {epochs} epochs, batch {BATCH} per rank, 2 ranks (checkpoint every epoch)",
        "fit_s": fit_s,
        "warm_epoch": WARM_EPOCH,
        "plain_keras": _growth([e["rss"] for e in plain]),
        "ranks": {str(r): _growth([e["rss"] for e in s]) for r, s in ranks.items()},
        "driver_python": _growth(driver_py),
        "driver_jvm": _growth(driver_jvm),
    }
    worst_rank = max(out["ranks"].values(), key=lambda g: g["growth_mib"])
    out["rank_growth_over_plain_mib"] = worst_rank["growth_mib"] - out["plain_keras"]["growth_mib"]
    # Target: flat. A rank grows no more than plain Keras does plus 16 MiB over the run, and the driver's
    # Python process by at most 16 MiB (the JVM is Spark's, reported beside it).
    out["target_ranks_flat"] = out["rank_growth_over_plain_mib"] <= 16
    out["target_driver_flat"] = out["driver_python"]["growth_mib"] <= 16
    print(write("memory", out))
    for name, g in [("plain", out["plain_keras"]), *[(f"rank {r}", g) for r, g in out["ranks"].items()]]:
        print(f"{name}: {g['at_warm_mib']:.0f} -> {g['last_mib']:.0f} MiB ({g['slope_mib_per_epoch']:+.2f} MiB/epoch)")
    for name in ("driver_python", "driver_jvm"):
        g = out[name]
        print(f"{name}: {g['at_warm_mib']:.0f} -> {g['last_mib']:.0f} MiB ({g['slope_mib_per_epoch']:+.2f} MiB/epoch)")


if __name__ == "__main__":
    cli(main)
