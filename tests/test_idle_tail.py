"""Issue 38's idle tail: a rank stayed 8-40 s in ``model.fit`` after its last epoch, destroying its
``tf.data`` iterator, whose destructor joined the autotuning model's thread while that thread slept
out its optimization period (up to 60 s). Every dataset a rank hands Keras now runs without the
autotuning model, so there is no such thread to wait for; these tests fail if one of them gets it back.
No timing: the datasets' options say whether the model thread will exist."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common.dataplan import Unit, epoch_plan
from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec
from hvd_spark._internal.rank.reader import planned_dataset, rank_dataset


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """2 files of 40 rows in row groups of 20: 'x' list<float> of 4, 'y' float label."""
    d = tmp_path_factory.mktemp("tail")
    files = []
    for i in range(2):
        x = np.arange(i * 160, (i + 1) * 160, dtype="float32").reshape(40, 4)
        t = pa.table({"x": pa.array(list(x), type=pa.list_(pa.float32())), "y": pa.array(x[:, 0] % 2)})
        path = str(d / f"part-{i}.parquet")
        pq.write_table(t, path, row_group_size=20)
        files.append(path)
    return files


def _data_kw():
    return {
        "features": [ColumnInfo("x", "array", "float", False, stored="x")],
        "labels": [ColumnInfo("y", "scalar", "float", False, stored="y")],
        "weight": None,
        "inputs": [TensorSpec("x", (4,), "float32")],
        "outputs": [TensorSpec("y", (1,), "float32")],
    }


def _rows(ds, steps: int) -> int:
    """Rows in the first ``steps`` batches, each batch (rows, 4) features and (rows, 1) labels."""
    shapes = [(tuple(x.shape), tuple(y.shape)) for x, y in ds.take(steps)]
    assert all(sx[1:] == (4,) and sy == (sx[0], 1) for sx, sy in shapes), shapes
    return sum(sx[0] for sx, _ in shapes)


def test_rank_dataset_runs_without_the_autotune_model(table):
    with rank_dataset(table, batch_size=16, shuffle=True, shuffle_buffer_size=40, seed=1, **_data_kw()) as ds:
        assert ds.options().autotune.enabled is False
        assert _rows(ds, 10) >= 80  # endless: more than a pass in 10 batches of up to 16
    with rank_dataset(
        table, batch_size=16, shuffle=False, shuffle_buffer_size=1, seed=1, passes=1, **_data_kw()
    ) as val:  # validation: one pass
        assert val.options().autotune.enabled is False
        assert _rows(val, 100) == 80


def test_planned_dataset_runs_without_the_autotune_model(table):
    units = [Unit(f, g, 20) for f in range(2) for g in range(2)]
    plan = epoch_plan(units, 0, seed=0, shuffle=False, window_rows=0)
    ds = planned_dataset(
        table, units, lambda: iter([(plan, ((0, 80),), 80)]), batch_size=16, source=None, workers=1, **_data_kw()
    )
    assert ds.options().autotune.enabled is False
    assert _rows(ds, 100) == 80
