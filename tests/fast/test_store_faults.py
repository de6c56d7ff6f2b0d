"""The store's answers to faults, without Spark: the one retry policy (``common/retry.py``) and the
checks of a checkpoint's files before a run resumes from it (``Store.latest_checkpoint``).

The faults are real where they can be here: a local server socket that refuses, files cut short or
rewritten on disk. S3's own answers (503 SlowDown) are built as botocore builds them.
"""

import errno
import json
import logging
import os
import pickle
import socket

import pytest

from hvd_spark._internal.common import retry
from hvd_spark._internal.data.store import Store, checkpoint_names, file_digest, job_config
from hvd_spark.errors import StoreUnavailableError


class _Clock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _refused() -> ConnectionRefusedError:
    """A real refused connection: a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError as e:
        return e
    raise AssertionError("a closed port accepted a connection")


class _ClientError(Exception):
    """botocore.exceptions.ClientError's shape (its ``response``), as s3fs receives it."""

    def __init__(self, code: str, status: int):
        self.response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        super().__init__(f"An error occurred ({code})")


def _s3fs_translated(code: str, status: int) -> OSError:
    error = OSError(errno.EBUSY, code)  # s3fs's translate_boto_error for SlowDown / 503
    error.__cause__ = _ClientError(code, status)
    return error


class EndpointConnectionError(Exception):  # botocore's, by name (retry.py never imports botocore)
    pass


@pytest.mark.parametrize(
    "error, transient",
    [
        (_refused(), True),
        (ConnectionResetError(errno.ECONNRESET, "reset"), True),
        (TimeoutError("read timed out"), True),
        (EndpointConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:1/b"'), True),
        (_s3fs_translated("SlowDown", 503), True),
        (_s3fs_translated("InternalError", 500), True),
        (_ClientError("ThrottlingException", 400), True),
        (FileNotFoundError("no such key"), False),
        (PermissionError(errno.EACCES, "denied"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (OSError(errno.EBUSY, "device busy"), False),  # a local EBUSY: no server asked to come back
        (ValueError("bad JSON"), False),
    ],
)
def test_which_errors_are_transient(error, transient):
    assert retry.is_transient(error) is transient


def test_a_transient_error_wrapped_by_another_library_is_transient():
    try:
        try:
            raise _refused()
        except ConnectionRefusedError as e:
            raise OSError("fsspec could not open the file") from e
    except OSError as wrapped:
        assert retry.is_transient(wrapped)


def test_an_outage_shorter_than_the_window_is_bridged_with_backoff(caplog):
    clock, calls = _Clock(), []

    def op():
        calls.append(clock.now)
        if clock.now < 20:
            raise _refused()
        return "listed"

    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        out = retry.call("s3://b/p", "listing runs/r1/checkpoints", op, seconds=120, sleep=clock.sleep, clock=clock)
    assert out == "listed"
    assert clock.sleeps[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0]  # doubling, capped at 15 s
    assert "listing runs/r1/checkpoints failed (ConnectionRefusedError" in caplog.text
    assert "succeeded after" in caplog.text


def test_past_the_window_the_error_names_the_store_the_operation_and_the_cause():
    clock = _Clock()

    def op():
        raise EndpointConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:9/b"')

    with pytest.raises(StoreUnavailableError) as info:
        retry.call("s3://bucket/prefix", "writing runs/r1/run.json", op, seconds=10, sleep=clock.sleep, clock=clock)
    first = str(info.value).splitlines()[0]
    assert first.startswith("store s3://bucket/prefix: writing runs/r1/run.json failed: EndpointConnectionError")
    assert clock.now <= 10 and sum(clock.sleeps) <= 10
    assert isinstance(info.value.__cause__, EndpointConnectionError)
    again = pickle.loads(pickle.dumps(info.value))  # it crosses from a rank to the driver
    assert str(again) == str(info.value) and again.operation == "writing runs/r1/run.json"


def test_other_errors_are_raised_at_once():
    clock = _Clock()

    def op():
        raise FileNotFoundError("runs/r1/run.json")

    with pytest.raises(FileNotFoundError):
        retry.call("s3://b", "reading", op, seconds=60, sleep=clock.sleep, clock=clock)
    assert clock.sleeps == []


def test_nested_operations_retry_once_not_once_each():
    clock, inner_calls = _Clock(), []

    def inner():
        inner_calls.append(1)
        raise _refused()

    def outer():
        return retry.call("s3://b", "inner", inner, seconds=5, sleep=clock.sleep, clock=clock)

    with pytest.raises(StoreUnavailableError, match="outer failed"):
        retry.call("s3://b", "outer", outer, seconds=5, sleep=clock.sleep, clock=clock)
    assert len(inner_calls) == len(clock.sleeps) + 1  # one call per outer try


def test_the_store_retries_its_operations_and_ships_its_window(tmp_path, monkeypatch):
    store = Store(str(tmp_path), retry_window=3)
    assert store.retry_window == 3.0
    assert Store.from_config(job_config(store)).retry_window == 3.0
    monkeypatch.setenv("HVD_SPARK_STORE_RETRY_WINDOW", "7")
    plain = Store(str(tmp_path))
    assert plain.retry_window == 7.0 and "retry_window" not in plain.to_config()  # saved estimators keep the setting
    assert job_config(plain)["retry_window"] == 7.0  # the ranks use the driver's
    with pytest.raises(ValueError, match="retry_window must be"):
        Store(str(tmp_path), retry_window=-1)

    failures = iter([_refused(), _refused()])
    real_ls = store.files.fs.ls

    def flaky_ls(path, **kw):
        error = next(failures, None)
        if error is not None:
            raise error
        return real_ls(path, **kw)

    monkeypatch.setattr(store.files.fs, "ls", flaky_ls)
    store.files.write_json(store.files.path("runs", "r1", "run.json"), {"a": 1})
    assert store.files.listdir(store.run_path("r1")) == ["run.json"]  # after two refused tries


# --- checkpoints: verified before a run resumes from them -------------------------------------------


def _checkpoint(store: Store, run_id: str, epoch: int, payload: bytes, tmp_path) -> tuple[str, str]:
    """A checkpoint as a rank writes it: the model, then the JSON with its size and digest."""
    model_name, meta_name = checkpoint_names(epoch)
    local = tmp_path / f"local-{epoch}.keras"
    local.write_bytes(payload)
    folder = store.checkpoints_path(run_id)
    store.files.upload_file(str(local), f"{folder}/{model_name}")
    store.files.write_json(f"{folder}/{meta_name}", {"history": [{"loss": 1.0}] * epoch, **file_digest(str(local))})
    return f"{folder}/{model_name}", f"{folder}/{meta_name}"


@pytest.mark.parametrize("damage", ["truncated model", "rewritten model", "truncated json", "model gone"])
def test_a_damaged_newest_checkpoint_is_skipped_and_named(tmp_path, caplog, damage):
    store = Store(str(tmp_path / "store"))
    for epoch in (1, 2, 3):
        model, meta = _checkpoint(store, "r1", epoch, os.urandom(4096), tmp_path)
    if damage == "truncated model":
        with open(model, "r+b") as f:
            f.truncate(2048)
    elif damage == "rewritten model":
        with open(model, "r+b") as f:
            f.write(b"x" * 16)  # same size, other bytes
    elif damage == "truncated json":
        text = open(meta).read()
        open(meta, "w").write(text[: len(text) // 2])
    else:
        os.remove(model)
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        latest = store.latest_checkpoint("r1")
    assert latest is not None and latest.epoch == 2
    if damage != "model gone":  # a model without its file is not even listed as complete
        assert "the checkpoint of epoch 3" in caplog.text and "is damaged" in caplog.text
    assert [c.epoch for c in store.checkpoints("r1")] == ([1, 2, 3] if damage != "model gone" else [1, 2])


def test_the_fit_that_resumes_sets_damaged_checkpoints_aside_and_keeps_them(tmp_path):
    store = Store(str(tmp_path / "store"))
    for epoch in (1, 2, 3):
        model, meta = _checkpoint(store, "r1", epoch, os.urandom(1000), tmp_path)
    with open(model, "r+b") as f:
        f.truncate(10)
    assert store.latest_checkpoint("r1", set_aside=True).epoch == 2
    assert [c.epoch for c in store.checkpoints("r1")] == [1, 2]  # epoch 3 can be written again
    aside = sorted(os.listdir(os.path.join(store.checkpoints_path("r1"), "damaged")))
    assert [n.split("-", 1)[1] for n in aside] == ["epoch-0003.json", "epoch-0003.keras"]  # kept, not deleted


def test_a_checkpoint_of_an_earlier_version_is_checked_as_a_zip_archive(tmp_path):
    import zipfile

    store = Store(str(tmp_path / "store"))
    folder = store.checkpoints_path("r1")
    store.files.makedirs(folder)
    for epoch in (1, 2):
        model_name, meta_name = checkpoint_names(epoch)
        with zipfile.ZipFile(f"{folder}/{model_name}", "w") as z:
            z.writestr("config.json", json.dumps({"epoch": epoch}) * 100)
        store.files.write_json(f"{folder}/{meta_name}", {"history": []})  # no size nor digest recorded
    assert store.latest_checkpoint("r1").epoch == 2
    path = f"{folder}/{checkpoint_names(2)[0]}"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert store.latest_checkpoint("r1").epoch == 1


def test_an_error_raised_while_handling_a_transient_one_is_not_transient():
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError:
            raise ValueError("a bug in the handler")  # noqa: B904 - the implicit context is the point
    except ValueError as e:
        assert e.__context__ is not None and not retry.is_transient(e)


def test_at_most_caps_the_window_of_the_operations_inside():
    clock = _Clock()

    def op():
        raise _refused()

    with retry.at_most(2), pytest.raises(StoreUnavailableError) as info:
        retry.call("s3://b", "a heartbeat", op, seconds=120, sleep=clock.sleep, clock=clock)
    assert clock.now <= 2 and info.value.window == 2
    with pytest.raises(StoreUnavailableError):  # the cap ends with the block
        retry.call("s3://b", "after", op, seconds=5, sleep=clock.sleep, clock=clock)
    assert clock.now > 4
