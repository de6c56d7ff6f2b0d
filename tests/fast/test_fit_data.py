"""A fit's data (``data/fit_data.py``) and the fit's one entry (``ml/steps.py``'s ``run``): ``fit(df)``
and ``fit_on_parquet`` both hand it their data as an argument, ``fit_on_parquet``'s files given rather
than found in a query plan (no Spark: the files are written with pyarrow, the steps stood in for)."""

import logging
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common.specs import ColumnInfo
from hvd_spark._internal.data import fit_data, inplace
from hvd_spark._internal.data.fit_data import FitInput
from hvd_spark._internal.data.store import Store
from tests.fast.test_store_faults import _refused

X = ColumnInfo("x", "scalar", "double", False)
Y = ColumnInfo("y", "scalar", "bigint", True)


def _files(tmp_path, n=2):
    urls = []
    for i in range(n):
        path = tmp_path / "t" / f"part-{i}.parquet"
        path.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"x": [1.0, 2.0, 3.0], "y": [0, 1, 0]}), str(path))
        urls.append(str(path))
    return urls


def _given(urls, val=()):
    scan = inplace.Scan(tuple(urls), {"x": "x", "y": "y", "z": "z"}, "t", "t")
    return FitInput(None, scan, tuple(val))


def test_given_files_are_read_in_place_with_their_validation_files(tmp_path):
    urls = _files(tmp_path)
    data = _given(urls, val=urls[1:])
    store = Store.create(str(tmp_path / "store"))
    found, how = fit_data.read_in_place(data, [X], [Y], None, None, store, reader="arrow", materialize="auto", seed=0)
    assert how == "fit_on_parquet('t')" and data.given
    scan, status, _, val_files = found
    assert scan is data.scan and val_files == (urls[1],) and len(status) == 2
    source = fit_data.table_source(found, [X], [Y], None, None, 0)
    assert source.split == ("files", (urls[1],))
    record = fit_data.identify(None, found, None, random_seed=0, sample_weight_col=None, copy_reason="").record
    assert record["read"] == "in place" and record["validation_files"] == [urls[1]]
    assert [f[0] for f in record["files"]] == sorted(urls)


def test_given_files_are_never_copied(tmp_path):
    urls = _files(tmp_path, 1)
    store = Store.create(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="fit_on_parquet reads with reader='arrow'. Received: reader='petastorm'"):
        fit_data.read_in_place(
            _given(urls), [X], [Y], None, None, store, reader="petastorm", materialize="auto", seed=0
        )
    missing = ColumnInfo("z", "scalar", "double", False)
    with pytest.raises(ValueError, match=r"fit_on_parquet: 't' cannot be trained on: column 'z' is not in"):
        fit_data.read_in_place(
            _given(urls), [missing], [Y], None, None, store, reader="arrow", materialize="auto", seed=0
        )


# Run in a fresh interpreter: the estimator's module loads pyspark.ml, which this tier's own process must not.
_ENTRIES = """
import sys
import pyarrow as pa, pyarrow.parquet as pq
from hvd_spark._internal.data import fit_data, inplace
from hvd_spark._internal.data.fit_data import FitInput
from hvd_spark._internal.ml import estimator as estimator_mod, steps
from hvd_spark._internal.ml.fit_params import FitParams

class Model:  # what the model param's converter recognizes a Keras model by
    layers = []
    def get_weights(self):
        return []

tmp = sys.argv[1]
runs = []
steps.run = lambda data, p, backend, framework: runs.append((data, p, backend, framework)) or "model"
given = FitInput(None, inplace.Scan((tmp + "/t/part-0.parquet",), {"x": "x"}, "t", "t"))
fit_data.parquet_input = lambda path, val, store, session: given
est = estimator_mod.HorovodEstimator(store=tmp + "/s", model=Model(), feature_cols=["x"], label_cols=["y"])
class Frame:  # a DataFrame's stand-in: fit looks for a Spark DataFrame's sparkSession and schema
    sparkSession = schema = None

frame = Frame()
assert est.fit(frame) == "model"  # the steps are stood in for: any frame
assert est.fit_on_parquet(tmp + "/t", params={est.epochs: 3}) == "model"
(fit, fit_p, _, fw), (on_parquet, on_parquet_p, _, fw2) = runs
from hvd_spark._internal.ml.framework import KERAS
assert fw is KERAS and fw2 is KERAS  # the estimator's framework, for both
assert fit == FitInput(frame) and not fit.given and isinstance(fit_p, FitParams) and fit_p.epochs == 1
assert on_parquet is given and on_parquet_p.epochs == 3  # fit_on_parquet's params, on a copy
assert est.getEpochs() == 1 and not hasattr(est, "_forced_scan")
try:
    est.fit_on_parquet(tmp + "/t", params={est.materialize: "always"})
    raise AssertionError("materialize='always' taken")
except ValueError as e:
    assert "materialize='always' does not apply to it" in str(e), e
assert len(runs) == 2
print("ok")
"""


def test_fit_and_fit_on_parquet_call_the_steps_with_their_data(tmp_path):
    out = subprocess.run([sys.executable, "-c", _ENTRIES, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr[-3000:]


def _a_plain_scan(monkeypatch, urls):
    """``fit(df)`` of a plain Parquet scan: the query plan's verdict (Spark's, not in this tier) stood in for."""
    scan = inplace.Scan(tuple(urls), {"x": "x", "y": "y", "z": "z"}, "t", "")
    monkeypatch.setattr(inplace, "read_plan", lambda frame, needed: inplace.Decision(scan, "it is a plain scan of t"))
    return FitInput(object())


@pytest.mark.parametrize("failing", ["info", "open"])
def test_an_outage_while_planning_fails_the_fit_instead_of_copying(tmp_path, monkeypatch, caplog, failing):
    """Issue 47.5: the table's filesystem refusing while step 1 lists the files or reads the first footer was
    caught as "cannot be read in place", and the fit copied the whole table (the cause an INFO line), so a
    resumed run in place was then refused as trained on other data. Now the one retry policy retries it and,
    past the window, the fit fails with StoreUnavailableError before anything is written."""
    from fsspec.implementations.local import LocalFileSystem

    from hvd_spark.errors import StoreUnavailableError

    urls = _files(tmp_path)
    store = Store.create(str(tmp_path / "store"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    data = _a_plain_scan(monkeypatch, urls)
    calls = []
    real = getattr(LocalFileSystem, failing)

    def refusing(self, path, *args, **kw):
        if str(path).startswith(str(tmp_path / "t")):
            calls.append(path)
            raise _refused()
        return real(self, path, *args, **kw)

    monkeypatch.setattr(LocalFileSystem, failing, refusing)
    monkeypatch.setenv("HVD_SPARK_STORE_RETRY_WINDOW", "1")  # one retry 0.5 s after the first try, then past it
    caplog.set_level(logging.INFO, logger="hvd_spark")
    with pytest.raises(StoreUnavailableError) as info:
        fit_data.read_in_place(data, [X], [Y], None, None, store, reader="arrow", materialize="auto", seed=0)
    message = str(info.value)
    assert "\n" not in message and "ConnectionRefusedError" in message and str(tmp_path / "t") in message, message
    assert info.value.tries == 2 and len(calls) >= 2  # retried, not taken for a file that cannot be read
    assert "copying the data" not in caplog.text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_file_that_cannot_be_read_in_place_is_still_copied(tmp_path, monkeypatch, caplog):
    """Only a reason of the files themselves (here a column missing from the first file) makes ``auto`` copy."""
    urls = _files(tmp_path)
    store = Store.create(str(tmp_path / "store"))
    data = _a_plain_scan(monkeypatch, urls)
    caplog.set_level(logging.INFO, logger="hvd_spark")
    missing = ColumnInfo("z", "scalar", "double", False)
    found, reason = fit_data.read_in_place(
        data, [missing], [Y], None, None, store, reader="arrow", materialize="auto", seed=0
    )
    assert found is None and reason.startswith("ValueError: column 'z' is not in the Parquet file"), reason
    assert "copying the data to the store: it cannot be read in place because ValueError" in caplog.text
