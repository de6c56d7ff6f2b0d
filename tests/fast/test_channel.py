"""The Spark Connect channel (channel.py): what the coordinator writes reaches the client in order,
once, through a store folder; without a store the records are kept, rank output capped per rank."""

import logging

from hvd_spark._internal.common import channel
from hvd_spark._internal.data.store import Store


def test_live_channel_delivers_in_order_once_and_is_removed(tmp_path):
    store = Store(str(tmp_path / "store"))
    path = store.files.path("runs", "r", "_live", "job1")
    writer = channel.ChannelWriter(store, path, interval=0.05)
    reader = channel.ChannelReader(store, path)
    writer.put({"k": "start"})
    writer.log(0, "first")
    writer.event(1, {"epoch": 1})
    got = []
    for _ in range(200):
        got += reader.poll()
        if len(got) >= 3:
            break
        writer._stop.wait(0.02)
    writer.say(logging.ERROR, "rank 1 failed")
    assert writer.close() == []  # a live channel keeps nothing
    got += reader.poll()
    assert got == [
        {"k": "start"},
        {"k": "log", "rank": 0, "line": "first"},
        {"k": "event", "rank": 1, "payload": {"epoch": 1}},
        {"k": "say", "level": logging.ERROR, "msg": "rank 1 failed"},
    ]
    assert reader.poll() == []  # nothing twice
    reader.remove()
    assert not (tmp_path / "store" / "runs" / "r" / "_live").exists()


def test_kept_channel_caps_output_per_rank(monkeypatch):
    monkeypatch.setattr(channel, "MAX_KEPT_LINES", 3)
    writer = channel.ChannelWriter()
    for i in range(5):
        writer.log(0, f"line {i}")
    writer.log(1, "other rank")
    writer.event(0, {"epoch": 1})  # events are never dropped
    kept = writer.close()
    assert [r.get("line") for r in kept if r["k"] == "log"] == ["line 0", "line 1", "line 2", "other rank"]
    assert {"k": "event", "rank": 0, "payload": {"epoch": 1}} in kept
    assert kept[-1]["msg"] == "2 more output lines of rank 0 dropped"


def test_show_sends_records_where_a_classic_driver_would(caplog):
    events = []
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        channel.show(
            [
                {"k": "log", "rank": 1, "line": "hello"},
                {"k": "event", "rank": 0, "payload": {"epoch": 2}},
                {"k": "say", "level": logging.WARNING, "msg": "careful"},
            ],
            lambda rank, payload: events.append((rank, payload)),
        )
    assert events == [(0, {"epoch": 2})]
    assert "[rank 1] hello" in caplog.text and "careful" in caplog.text
