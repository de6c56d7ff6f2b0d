"""``rank/ahead.py``'s ``read_ahead``: the torch ranks' batches prepared by a thread, in order, with the
producer's error raised in its place and the producer stopped when the consumer stops early."""

import time

import pytest

from hvd_spark._internal.rank.ahead import read_ahead


def test_items_come_in_their_order():
    assert list(read_ahead(iter(range(100)), depth=3)) == list(range(100))
    assert list(read_ahead(iter([]))) == []


def test_the_producers_error_is_raised_after_the_items_before_it():
    def items():
        yield 1
        yield 2
        raise OSError("store unreachable")

    got = []
    with pytest.raises(OSError, match="store unreachable"):
        for x in read_ahead(items()):
            got.append(x)
    assert got == [1, 2]


def test_a_consumer_stopping_early_stops_the_producer():
    produced = []

    def items():
        for i in range(10_000):
            produced.append(i)
            yield i

    for x in read_ahead(items(), depth=2):
        if x == 3:
            break
    time.sleep(0.5)  # time for a producer that did not stop to run on
    # consumed 4, at most 2 queued and 1 in the producer's hand when it saw the stop
    assert len(produced) <= 4 + 2 + 1, len(produced)
