"""rank/pysource.py: the readers' Python iterators feed tf.data without ``from_generator``, whose
GeneratorDataset kernel made every training step fed through it 1.6-1.9x slower (issue 38; the
figures are in the module's docstring and benchmarks/results/vs_keras.json, not asserted here)."""

import numpy as np
import pytest
import tensorflow as tf
from test_idle_tail import _data_kw, table  # noqa: F401 - the fixture

from hvd_spark._internal.common.dataplan import Unit, epoch_plan
from hvd_spark._internal.rank import pysource
from hvd_spark._internal.rank.pysource import python_source, reraise_source_error
from hvd_spark._internal.rank.reader import planned_dataset, rank_dataset

SIG = {"x": tf.TensorSpec((None, 3), tf.float32), "s": tf.TensorSpec((None,), tf.string)}


def _blocks(n: int, start: int = 0):
    for i in range(start, start + n):
        yield {"x": np.full((i + 1, 3), i, np.float32), "s": np.array([f"r{i}".encode()] * (i + 1), dtype=object)}


def test_elements_come_in_order_with_their_shapes_and_each_iteration_starts_again():
    calls = []

    def make():
        calls.append(1)
        return _blocks(4)

    ds = python_source(make, SIG)
    assert ds.element_spec["x"].shape.as_list() == [None, 3]
    for _ in range(2):  # a second pass restarts the iterator
        got = [(int(e["x"].shape[0]), float(e["x"][0, 0]), e["s"][0].numpy()) for e in ds]
        assert got == [(1, 0.0, b"r0"), (2, 1.0, b"r1"), (3, 2.0, b"r2"), (4, 3.0, b"r3")]
    assert len(calls) == 2
    assert [int(e["x"].shape[0]) for e in ds.repeat(2)] == [1, 2, 3, 4] * 2
    assert list(python_source(lambda: iter(()), SIG)) == []  # an empty iterator: an empty dataset


def test_an_error_of_the_iterator_comes_back_as_itself():
    class ReadFailed(OSError):
        pass

    def make():
        yield from _blocks(2)
        raise ReadFailed("row group 7 of part-3.parquet: connection reset")

    ds = python_source(make, SIG)
    with pytest.raises(tf.errors.OpError) as wrapped:
        list(ds)
    assert "ReadFailed" in wrapped.value.message
    with pytest.raises(ReadFailed, match="row group 7 of part-3.parquet") as original:
        reraise_source_error(wrapped.value)
    assert original.value.__cause__ is wrapped.value
    reraise_source_error(ValueError("not TensorFlow's"))  # anything else: returns, the caller raises it
    reraise_source_error(tf.errors.UnknownError(None, None, "another error"))


def test_abandoned_iterations_are_closed():
    closed = []

    def make():
        try:
            yield from _blocks(100)
        finally:
            closed.append(1)

    ds = python_source(make, SIG)
    for _ in range(pysource._KEEP + 3):
        next(iter(ds))  # one element, then abandoned
    assert len(closed) >= 3


def _ops(ds) -> set:
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(ds._as_serialized_graph().numpy())
    ops = {n.op for n in graph.node}
    for f in graph.library.function:
        ops |= {n.op for n in f.node_def}
    return ops


def test_the_readers_have_no_generator_dataset(table):  # noqa: F811
    units = [Unit(f, g, 20) for f in range(2) for g in range(2)]
    plan = epoch_plan(units, 0, seed=0, shuffle=True, window_rows=40)
    ds = planned_dataset(
        table, units, lambda: iter([(plan, ((0, 80),), 80)]), batch_size=16, source=None, workers=1, **_data_kw()
    )
    ops = _ops(ds)
    assert "PyFunc" in ops and "GeneratorDataset" not in ops, sorted(ops)
    assert sum(int(x.shape[0]) for x, _ in ds) == 80
    with rank_dataset(table, batch_size=16, shuffle=True, shuffle_buffer_size=40, seed=1, **_data_kw()) as ds:
        ops = _ops(ds)
        assert "PyFunc" in ops and "GeneratorDataset" not in ops, sorted(ops)
