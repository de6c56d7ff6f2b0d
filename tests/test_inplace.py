"""Tables read in place (materialize="auto" / "never"): a Parquet path and a catalog table train the
same model to the same numbers as the copy, what cannot be read in place is refused (or copied) with
its reason before any work, and files changed between or during fits are noticed. Real Spark (the
shared local[2] session), real ranks over Gloo, real Parquet."""

import dataclasses
import logging
import os
import sys

import keras
import numpy as np
import pytest
from _helpers import small_model, xor_estimator

from hvd_spark import DataChangedError, Store
from hvd_spark._internal.data import inplace


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _table(spark, path, n=512, seed=0):
    """``n`` xor rows written as Parquet at ``path`` after a shuffle: a Vector ``xv``, the scalars ``a``
    and ``b``, the label ``y`` and ``is_val`` (every 4th row). Returns the rows as numpy."""
    import pandas as pd
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 2))
    y = ((x[:, 0] * x[:, 1]) > 0).astype("int64")
    pdf = pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "y": y, "is_val": (np.arange(n) % 4 == 0)})
    df = spark.createDataFrame(pdf).repartition(3, "y").withColumn("xv", array_to_vector(F.array("a", "b")))
    df.write.mode("overwrite").parquet(str(path))
    return x, y


def _weights(model):
    return [np.asarray(w) for w in model.getModel().get_weights()]


def test_a_parquet_path_a_catalog_table_and_the_copy_train_the_same(spark, tmp_path, caplog):
    """Full-batch steps (one batch of each rank's share), so the gradient is the same sum however the
    rows are ordered: the three fits must agree to float tolerance, validation (a column) included."""
    _table(spark, tmp_path / "t")
    spark.sql("DROP TABLE IF EXISTS inplace_xor")
    spark.read.parquet(str(tmp_path / "t")).write.option("path", str(tmp_path / "tbl")).saveAsTable("inplace_xor")
    model = small_model()
    fits = {}
    for name, frame, mode in [
        ("path", spark.read.parquet(str(tmp_path / "t")).select("xv", "y", "is_val"), "never"),
        ("table", spark.table("inplace_xor"), "never"),
        ("copy", spark.read.parquet(str(tmp_path / "t")), "always"),
    ]:
        store = tmp_path / f"store-{name}"
        est = xor_estimator(
            store,
            model=keras.models.clone_model(model),
            feature_cols=["xv"],
            validation="is_val",
            batch_size=192,  # 384 train rows: one full batch per rank
            epochs=3,
            optimizer=keras.optimizers.SGD(0.5),
            materialize=mode,
            verbose=0,
        )
        est.getModel().set_weights(model.get_weights())
        with caplog.at_level(logging.INFO, logger="hvd_spark"):
            caplog.clear()
            fits[name] = est.fit(frame)
        parquet = [f for _, _, fs in os.walk(store / "data") for f in fs if f.endswith(".parquet")]
        assert bool(parquet) == (mode == "always"), parquet  # nothing copied in place
        said = caplog.text
        assert ("reading the data in place" in said) == (mode == "never"), said
    base = fits["copy"].getHistory()
    assert len(base["loss"]) == 3 and len(base["val_loss"]) == 3
    for name in ("path", "table"):
        np.testing.assert_allclose(fits[name].getHistory()["loss"], base["loss"], rtol=1e-5)
        np.testing.assert_allclose(fits[name].getHistory()["val_loss"], base["val_loss"], rtol=1e-5)
        for w, v in zip(_weights(fits[name]), _weights(fits["copy"])):
            np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert base["loss"][-1] < base["loss"][0]  # it trained


def test_what_cannot_be_read_in_place_is_named(spark, tmp_path):
    from pyspark.sql import functions as F

    _table(spark, tmp_path / "t", n=64)
    src = spark.read.parquet(str(tmp_path / "t"))
    assert inplace.read_plan(src, ["xv", "y"]).scan is not None
    renamed = src.select(F.col("a").alias("left"), F.col("y").cast("double").alias("label"))
    ok = inplace.read_plan(renamed, ["left", "label"])
    assert ok.scan is not None and ok.scan.columns == {"left": "a", "label": "y"}
    cases = {
        "Filter": src.where("y > 0"),
        "computed": src.withColumn("c", F.col("a") * 2),
        "join": src.join(src.select("y").distinct(), "y"),
        "not Parquet": spark.createDataFrame([(1.0, 1)], ["c", "y"]),
    }
    for why, frame in cases.items():
        column = "c" if "c" in frame.columns else "xv"
        decision = inplace.read_plan(frame, [column, "y"])
        assert (
            decision.scan is None
            and why.lower() in decision.reason.lower()
            or (why == "join" and "several sources" in decision.reason)
        ), (why, decision.reason)
    cached = spark.read.parquet(str(tmp_path / "t")).cache()  # from now on src's plans read the cache too
    assert "cached" in inplace.read_plan(cached, ["xv", "y"]).reason
    cached.unpersist()
    partitioned = tmp_path / "p"
    src.write.partitionBy("y").parquet(str(partitioned))
    assert "partition column" in inplace.read_plan(spark.read.parquet(str(partitioned)), ["xv", "y"]).reason

    store = tmp_path / "store"
    with pytest.raises(
        ValueError, match="materialize='never': the DataFrame cannot be read in place because its query has a Filter"
    ):
        xor_estimator(store, feature_cols=["xv"], materialize="never").fit(src.where("y > 0"))
    assert not (store / "data").exists() or not list((store / "data").rglob("*"))  # nothing written


def test_nulls_in_a_table_read_in_place_are_refused_before_training(spark, tmp_path):
    import pandas as pd

    pdf = pd.DataFrame({"a": [0.5, None, 0.1, 0.3], "b": [0.1, 0.2, 0.3, 0.4], "y": [0, 1, 0, 1]})
    spark.createDataFrame(pdf).write.parquet(str(tmp_path / "t"))
    est = xor_estimator(tmp_path / "store", feature_cols=["a", "b"], materialize="never", verbose=0)
    with pytest.raises(
        ValueError, match=r"Feature column '\[a, b\]' has 1 of 4 rows with null, NaN or infinite values"
    ):
        est.fit(spark.read.parquet(str(tmp_path / "t")))


def test_a_table_overwritten_between_fits_is_scanned_again(spark, tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    _table(spark, tmp_path / "t", n=128)
    est = xor_estimator(store, feature_cols=["a", "b"], epochs=1, validation=0.25, verbose=0)
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        est.fit(spark.read.parquet(str(tmp_path / "t")))
        caplog.clear()
        est.fit(spark.read.parquet(str(tmp_path / "t")))  # unchanged: the scan is reused
        assert "reusing the scan" in caplog.text
        _table(spark, tmp_path / "t", n=256, seed=1)  # overwritten: other files
        caplog.clear()
        est.fit(spark.read.parquet(str(tmp_path / "t")))
        assert "reusing the scan" not in caplog.text and "scanned" in caplog.text
    rows = sorted((d["train_rows"] or 0) + (d["val_rows"] or 0) for d in store.datasets())
    assert rows == [128, 256]


class _TouchAfterFirstEpoch(keras.callbacks.Callback):
    """Rank 0 gives a file of the table a new modification time at the end of the fit's first epoch (a
    writer replacing it)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.done = False

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if not self.done and hvd.rank() == 0:
            st = os.stat(self.path)
            os.utime(self.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000_000))
        self.done = True


def test_a_file_changed_during_a_fit_fails_it(spark, tmp_path):
    """The fit resumes a run of one epoch; a file changes during its first epoch. Before: its final model
    stayed in the run, which Store.model_path returned and Store.runs counted."""
    _table(spark, tmp_path / "t", n=128)
    victim = sorted(str(p) for p in (tmp_path / "t").glob("part-*.parquet"))[0]
    store = Store(str(tmp_path / "store"))
    first = xor_estimator(store, feature_cols=["xv"], epochs=1, run_id="changed", verbose=0)
    kept = first.fit(spark.read.parquet(str(tmp_path / "t")))
    est = first.copy({first.epochs: 3, first.callbacks: [_TouchAfterFirstEpoch(victim)]})
    with pytest.raises(
        DataChangedError, match=r"changed while the fit trained on it.*keeps its checkpoints up to epoch 1"
    ):
        est.fit(spark.read.parquet(str(tmp_path / "t")))
    # The rejected fit left no result: the run's newest model is the first fit's, one model, one epoch.
    assert store.files.url(store.model_path("changed")) == kept.getModelUrl()
    assert [(r["models"], r["epochs"]) for r in store.runs()] == [(1, 1)]
    assert [c.epoch for c in store.checkpoints("changed")] == [1]
    # The run's epoch was trained on the table before the change: it does not go on on the changed one.
    with pytest.raises(ValueError, match=r"files of the table changed in size or modification time: part-"):
        first.copy({first.epochs: 3}).fit(spark.read.parquet(str(tmp_path / "t")))


def _store_state(root) -> dict:
    """Every file in the store, with its size and modification time (a fit's writer lease comes and goes)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_run_goes_on_only_with_its_own_data(spark, tmp_path):
    """A run's data is recorded in its run.json: its files with their identity, read in place, split by
    validation=0.25 and random_seed. The same files resume (on another number of ranks too) and a
    finished run returns its model; the same table copied (which draws other validation rows) and the
    table with a file added are refused before any work. Before: both went on without a word (the
    finished run returned its old model)."""
    path = tmp_path / "t"
    _table(spark, path, n=128)
    store = Store(str(tmp_path / "store"))
    est = xor_estimator(store, feature_cols=["a", "b"], validation=0.25, epochs=1, run_id="own", verbose=0)
    est.fit(spark.read.parquet(str(path)))
    resumed = est.copy({est.epochs: 2, est.num_proc: 1}).fit(spark.read.parquet(str(path)))
    assert len(resumed.getHistory()["val_loss"]) == 2 and len(resumed.getFitSummary().ranks) == 1
    finished = est.copy({est.epochs: 2}).fit(spark.read.parquet(str(path)))
    # the model the resuming fit returned (its end record), not a copy
    assert finished.getFitSummary() is None and finished.getModelUrl() == resumed.getModelUrl()

    before = _store_state(tmp_path / "store")
    with pytest.raises(
        ValueError,
        match=r"run_id 'own' in .* was trained on other data.*read: the table at \S+ read in place \(\d+ files; "
        r"validation rows drawn by file and row number\) -> a copy in the store \(validation rows drawn by the rows' "
        r"values, because its query has a Filter .*set_weights",
    ):
        est.copy({est.epochs: 3}).fit(spark.read.parquet(str(path)).where("y >= 0"))  # every row, copied
    import pyarrow.parquet as pq

    first = sorted(path.glob("part-*.parquet"))[0]
    pq.write_table(pq.read_table(first), path / "part-added.parquet")
    for epochs in (2, 3):  # finished, resumed
        with pytest.raises(ValueError, match=r"What differs \(run -> this fit\): files of the table added: part-added"):
            est.copy({est.epochs: epochs}).fit(spark.read.parquet(str(path)))
    assert _store_state(tmp_path / "store") == before  # the refused fits wrote nothing


# --- the scan: from footers where they suffice, kept in the store for later driver processes -----------


def _probe_table(spark, path, n=3000, seed=0):
    """``n`` rows in 3 files: ``x`` an array of 4 floats (only its values give its statistics), ``y`` an
    integer label."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    pdf = pd.DataFrame({"x": list(rng.normal(size=(n, 4)).astype("float32")), "y": rng.integers(0, 3, n)})
    spark.createDataFrame(pdf, "x array<float>, y int").repartition(3).write.mode("overwrite").parquet(str(path))


def _values_stats(source, files):
    """Every row group's statistics computed from its values on the driver (the scan without footers),
    merged, and (file, group, rows) of each."""
    import pyarrow.parquet as pq

    from hvd_spark._internal.common import sources

    parts, groups = [], []
    for i, url in enumerate(files):
        pf = pq.ParquetFile(url.removeprefix("file:"))
        offsets = sources.group_offsets(pf.metadata)
        for g in range(pf.num_row_groups):
            if pf.metadata.row_group(g).num_rows:
                parts.append(sources.row_group_stats(source, url, pf.read_row_group(g), offsets[g]))
                groups.append([i, g, parts[-1]["rows"] - parts[-1]["val_rows"], parts[-1]["val_rows"]])
    return sources.merge_stats(parts), groups


def test_a_table_of_integers_is_scanned_from_its_footers_alone(spark, tmp_path):
    """Spark's own Parquet writer (parquet-mr's statistics): integer, long, boolean and nullable columns
    summarized from the footers give the statistics the values give, and no Spark job runs."""
    import pandas as pd

    from hvd_spark._internal.common import sources

    n = 4000
    rng = np.random.default_rng(1)
    pdf = pd.DataFrame(
        {
            "a": rng.integers(-300, 300, n).astype("int32"),
            "b": rng.integers(-(2**35), 2**35, n),
            "flag": rng.integers(0, 2, n).astype(bool),
            "n": [None if k % 9 == 0 else int(k % 50) for k in range(n)],
            "y": rng.integers(0, 4, n).astype("int32"),
        }
    )
    schema = "a int, b bigint, flag boolean, n int, y int"
    spark.createDataFrame(pdf, schema).repartition(4).write.parquet(str(tmp_path / "t"))
    df = spark.read.parquet(str(tmp_path / "t"))
    scan = inplace.read_plan(df, ["a", "b", "flag", "n", "y"]).scan
    columns = (
        sources.SourceColumn("g", "group", ("a", "b"), "int64", "[a, b]"),
        sources.SourceColumn("flag", "scalar", ("flag",), "int32", "flag"),
        sources.SourceColumn("n", "scalar", ("n",), "int32", "n"),
        sources.SourceColumn("y", "scalar", ("y",), "int32", "y"),
    )
    status = tuple(inplace.list_status(scan.files, None))
    source = sources.TableSource(columns, ("fraction", 0.2, 5), status, None, scan.root)
    sc = spark.sparkContext
    sc.setJobGroup("footers-only", "the footer scan")
    try:
        meta = inplace.scan_table(
            spark, Store(str(tmp_path / "store")), scan, source, reuse=False, check=lambda s: None
        )
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert sc.statusTracker().getJobIdsForGroup("footers-only") == []  # no pass over the rows
    want, groups = _values_stats(source, scan.files)
    assert meta["stats"] == want and meta["units"] == groups
    ref = inplace.scan_table(
        spark, Store(str(tmp_path / "store")), scan, source, reuse=False, check=lambda s: None, use_footers=False
    )
    assert (ref["stats"], ref["units"]) == (meta["stats"], meta["units"])  # the Spark job over the values agrees
    cols = meta["stats"]["columns"]
    assert cols["n"]["bad"] == len(range(0, n, 9)) and (cols["flag"]["min"], cols["flag"]["max"]) == (0, 1)
    assert cols["[a, b]"]["min"] == min(pdf.a.min(), pdf.b.min()) and cols["[a, b]"]["max"] == pdf.b.max()
    assert meta["train_rows"] + meta["val_rows"] == n and 600 < meta["val_rows"] < 1000


def test_a_local_master_scans_on_the_driver_as_the_executors_would(spark, tmp_path):
    """On a local master the values are read by the driver's threads, not a Spark job (whose start cost
    a cold session 6-7 s for 1M rows of arrays): the same statistics and row groups, no job (the
    estimator asks for this path on a local master without Connect)."""
    from hvd_spark._internal.common import sources

    table = str(tmp_path / "t")
    _probe_table(spark, table)
    scan = inplace.read_plan(spark.read.parquet(table).select("x", "y"), ["x", "y"]).scan
    columns = (
        sources.SourceColumn("x", "array", ("x",), "float32", "x"),
        sources.SourceColumn("y", "scalar", ("y",), "int32", "y"),
    )
    source = sources.TableSource(columns, ("fraction", 0.25, 3), tuple(inplace.list_status(scan.files, None)), None)
    source = dataclasses.replace(source, root=scan.root)
    sc = spark.sparkContext
    results = {}
    for on_driver in (False, True):
        group = f"scan-{on_driver}"
        sc.setJobGroup(group, "the scan")
        try:
            results[on_driver] = inplace.scan_table(
                spark,
                Store(str(tmp_path / "store")),
                scan,
                source,
                reuse=False,
                check=lambda s: None,
                on_driver=on_driver,
            )
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
        jobs = len(sc.statusTracker().getJobIdsForGroup(group))
        assert jobs == 0 if on_driver else jobs >= 1, (on_driver, jobs)
    spark_job, driver = results[False], results[True]
    assert (driver["stats"], driver["units"]) == (spark_job["stats"], spark_job["units"])
    assert driver["train_rows"] + driver["val_rows"] == 3000 and driver["val_rows"] > 500


def test_the_scan_and_the_copy_key_are_kept_across_driver_processes(spark, tmp_path, caplog):
    """A second driver process (its own Spark JVM) finds the first one's scan in the store and runs no
    Spark job; the copy's dataset key is the same in both JVMs; a file touched since is scanned again
    under another key; a damaged kept scan is ignored (logged) and the table scanned again."""
    import json
    import subprocess

    from _scan_probe import probe

    table, store = str(tmp_path / "t"), str(tmp_path / "store")
    _probe_table(spark, table)
    cold = probe(spark, table, store)
    assert cold["jobs"] >= 1 and cold["portable"], cold  # the array's values are read: a Spark job
    assert probe(spark, table, store)["jobs"] == 0
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "_scan_probe.py"), table, store, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warm = json.loads(done.stdout.strip().splitlines()[-1])
    assert warm["jobs"] == 0, warm
    assert (warm["stats"], warm["units"]) == (cold["stats"], cold["units"])
    assert (warm["key"], warm["digest"]) == (cold["key"], cold["digest"])  # the copy is found again too

    victim = sorted((tmp_path / "t").glob("part-*.parquet"))[0]
    st = os.stat(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    touched = probe(spark, table, store)
    assert touched["jobs"] >= 1 and touched["key"] != cold["key"] and touched["digest"] != cold["digest"]
    assert (touched["stats"], touched["units"]) == (cold["stats"], cold["units"])  # same rows, scanned anew

    metas = [p for p in (tmp_path / "store" / "data").rglob("_hvd_spark_meta.json")]
    assert len(metas) == 2
    for meta in metas:
        meta.write_text('{"format": 4, "key": "cut sho')
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        again = probe(spark, table, store)
    assert again["jobs"] >= 1 and again["stats"] == cold["stats"]
    assert "ignoring the kept scan" in caplog.text and "scanning it again" in caplog.text


def test_the_portable_query_names_the_whole_computation(spark, tmp_path):
    """The copy's identity is portable across JVMs only where the plan's text names all of the
    computation, and then it tells computations apart, beyond the 25 columns a plan prints by default."""
    from pyspark.sql import functions as F

    from hvd_spark._internal.data.identity import data_identity

    wide = spark.range(50).select(*[(F.col("id") + k).alias(f"c{k}") for k in range(30)])
    wide.write.parquet(str(tmp_path / "w"))
    wide.write.csv(str(tmp_path / "csv"), header=True)
    src = spark.read.parquet(str(tmp_path / "w"))
    last = [F.col(f"c{k}") for k in range(29)]
    times2 = data_identity(src.select(*last, (F.col("c29") * 2).alias("z")))
    times3 = data_identity(src.select(*last, (F.col("c29") * 3).alias("z")))
    assert times2.portable and times3.portable and times2.digest != times3.digest
    again = data_identity(spark.read.parquet(str(tmp_path / "w")).select(*last, (F.col("c29") * 2).alias("z")))
    assert again.digest == times2.digest  # another DataFrame over the same files: the same identity

    @F.udf("long")
    def plus(x):
        return x + 1

    assert not data_identity(src.select(plus("c0"))).portable  # a UDF prints its name only
    assert not data_identity(spark.read.csv(str(tmp_path / "csv"), header=True)).portable  # options unprinted
    assert not data_identity(spark.createDataFrame([(1,)], "a int")).portable


def _integer_table(spark, path, n=600):
    """An xor-like table of integer columns (``a``, ``b``, the label ``y``): its footers give every
    statistic, so the scan reads no row group and only the ranks decode the pages."""
    import pandas as pd

    rng = np.random.default_rng(3)
    a, b = rng.integers(-5, 5, n).astype("int32"), rng.integers(-5, 5, n).astype("int32")
    pdf = pd.DataFrame({"a": a, "b": b, "y": ((a * b) > 0).astype("int32")})
    spark.createDataFrame(pdf, "a int, b int, y int").repartition(2).write.parquet(str(path))
    return sorted(str(p) for p in path.glob("part-*.parquet"))


def _garbage(path, footer: bool) -> None:
    """Random bytes over the file's pages (``footer``: over its footer's metadata instead), its size and
    modification time put back, so that every identity check passes (a file copied back from a damaged
    disk: no checksum file beside it)."""
    import struct

    st = os.stat(path)
    with open(path, "rb") as f:
        f.seek(st.st_size - 8)
        footer_len = struct.unpack("<i", f.read(4))[0]
    start = st.st_size - 8 - footer_len
    where, size = (start + 4, footer_len - 8) if footer else (4, start - 4)
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(np.random.default_rng(0).bytes(size))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    crc = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.crc")
    if os.path.exists(crc):  # Hadoop's local filesystem would find the damage by its checksum file
        os.remove(crc)


def test_a_damaged_footer_of_a_table_read_in_place_is_named(spark, tmp_path):
    """Issue 47.4: a footer that does not decode (its size and modification time put back) refuses the fit
    with materialize="never" before training, naming the file (before: "... cannot be read in place because
    OSError: Couldn't deserialize thrift: ..." without it)."""
    files = _integer_table(spark, tmp_path / "t")
    _garbage(files[1], footer=True)
    est = xor_estimator(tmp_path / "store", feature_cols=["a", "b"], epochs=1, materialize="never", verbose=0)
    with pytest.raises(ValueError) as refused:
        est.fit(spark.read.parquet(str(tmp_path / "t")))
    first = str(refused.value).splitlines()[0]
    print(f"damaged footer, materialize='never': {first}")
    assert "cannot be read in place" in first and os.path.basename(files[1]) in first


def test_damaged_pages_of_a_table_read_in_place_are_named_and_not_retried(spark, tmp_path):
    """Issue 47.4: pages that do not decode (the footer intact, so the scan passes from the footers; the
    file's size and modification time put back): the rank's read is neither retried as a store outage nor
    restarted, and the error's first line names the file (before: 8,983 characters without its name)."""
    files = _integer_table(spark, tmp_path / "u")
    _garbage(files[0], footer=False)
    est = xor_estimator(tmp_path / "store", feature_cols=["a", "b"], epochs=2, max_restarts=2, verbose=0)
    logs = _Lines()
    logging.getLogger("hvd_spark").addHandler(logs)
    try:
        with pytest.raises(Exception) as failed:  # noqa: PT011 - the type is checked below
            est.fit(spark.read.parquet(str(tmp_path / "u")))
    finally:
        logging.getLogger("hvd_spark").removeHandler(logs)
    text = str(failed.value)
    first = text.splitlines()[0]
    retried = [m for m in logs.lines if "retrying for up to" in m or "restarting" in m]
    print(
        f"damaged pages: {type(failed.value).__name__} of {len(text)} characters, first line of {len(first)}, "
        f"{len(retried)} retries/restarts logged: {first}"
    )
    assert "DamagedFileError" in first and os.path.basename(files[0]) in first and len(first) < 600
    assert not retried, retried


class _Lines(logging.Handler):
    """The log records of every level of hvd_spark's loggers (the ranks' lines included)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
