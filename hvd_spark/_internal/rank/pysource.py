"""A ``tf.data`` source fed by a Python iterator, without ``tf.data.Dataset.from_generator``.

Why not ``from_generator``: its ``GeneratorDataset`` kernel slows the training step of every model
fed through it, not only the reading. Measured on a 2-core host (an MLP of 74,497 parameters, 1,024
rows per step, the same rows from memory, medians of 3 alternated runs; issue 38): the compiled
train step took 5.1-5.7 ms with the data sliced from a tensor, and 8.5-10.7 ms when only the slice
*offsets* came from a ``from_generator`` dataset of 8 elements per epoch (the step's own time, inside
``train_function``, with 50% more CPU). The same offsets from a ``tf.numpy_function`` in a ``map``:
5.5-5.9 ms. So the Python side runs here as a ``numpy_function`` in a ``map`` over an endless
counter, cut where the iterator ends.

Exceptions of the iterator reach Keras as ``tf.errors.UnknownError`` (TensorFlow's wrapping of an
error in Python code); :func:`reraise_source_error` gives the caller the original exception back.
"""

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

_KEEP = 8  # iterators kept per source: older ones were abandoned (a pass not read to its end)


def python_source(make_iterator: Callable[[], Iterator[Any]], signature) -> "tf.data.Dataset":
    """A dataset of the elements ``make_iterator()`` yields, each of the structure of ``signature``
    (``tf.TensorSpec`` leaves; ``None`` dimensions allowed). Each iteration of the dataset calls
    ``make_iterator`` anew (a ``repeat`` or a second ``for`` reads it again)."""
    specs = tf.nest.flatten(signature)
    dtypes = [s.dtype for s in specs]
    empty = [np.zeros([0 if d is None else d for d in s.shape.as_list()], s.dtype.as_numpy_dtype) for s in specs]
    iterators: dict[int, Iterator[Any]] = {}
    lock = threading.Lock()
    keys = itertools.count()

    def start(_):
        with lock:
            key = next(keys)
            iterators[key] = iter(make_iterator())
            for old in [k for k in iterators if k <= key - _KEEP]:
                _close(iterators.pop(old))
        return np.int64(key)

    def pull(key):
        key = int(key)
        with lock:
            it = iterators.get(key)
        if it is None:
            return [*empty, np.bool_(False)]
        try:
            item = next(it)
        except StopIteration:
            with lock:
                iterators.pop(key, None)
            return [*empty, np.bool_(False)]
        except BaseException as e:
            _remember(e)  # see reraise_source_error
            raise
        values = tf.nest.flatten(item)
        return [np.asarray(v, dtype=d.as_numpy_dtype) for v, d in zip(values, dtypes)] + [np.bool_(True)]

    def one_pass(key):
        def step(_):
            *values, more = tf.numpy_function(pull, [key], [*dtypes, tf.bool], stateful=True)
            for v, s in zip(values, specs):
                v.set_shape(s.shape)
            return tuple(values), more

        counter = tf.data.Dataset.from_tensors(0).repeat()
        got = counter.map(step).take_while(lambda values, more: more)
        return got.map(lambda values, more: tf.nest.pack_sequence_as(signature, list(values)))

    first = tf.data.Dataset.from_tensors(np.int64(0)).map(
        lambda d: tf.ensure_shape(tf.numpy_function(start, [d], tf.int64, stateful=True), [])
    )
    return first.flat_map(one_pass)


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # an abandoned pass: nothing to report from closing it
            return


_seen: list[BaseException] = []
_seen_lock = threading.Lock()


def _remember(e: BaseException) -> None:
    with _seen_lock:
        _seen.append(e)
        del _seen[:-4]


def reraise_source_error(error: BaseException) -> None:
    """Raises the Python exception a source's iterator raised, when ``error`` (raised by Keras) is
    TensorFlow's wrapping of it; returns otherwise. The original keeps its type (a
    ``StoreUnavailableError`` stays one), with TensorFlow's error as its context."""
    if not isinstance(error, tf.errors.OpError):
        return
    with _seen_lock:
        candidates = list(reversed(_seen))
    for e in candidates:
        if type(e).__name__ in str(error.message) and str(e).split("\n", 1)[0][:200] in str(error.message):
            with _seen_lock:
                _seen.clear()
            raise e from error
