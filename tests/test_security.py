"""The exposure of a job's network services, with real ranks:

- Horovod's Gloo rendezvous (HTTP without authentication) serves on the task's address only, and
  only until every rank's ``hvd.init()`` has returned: it is closed while the ranks train;
- the driver service answers nothing, and changes nothing, for a connection without the job token.
"""

import json
import os
import socket
import sys

import pytest

import hvd_spark


@pytest.fixture(autouse=True)
def _by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _open(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


def rendezvous_life():
    """Each rank: whether the rendezvous answered before hvd.init(), the address it listens on (rank 0's
    host sees its socket), and how long after init and one allreduce it took to close (None: never)."""
    import time

    import horovod.tensorflow as hvd
    import psutil
    import tensorflow as tf

    addr, port = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    open_before = _open(addr, port)
    listening = sorted(
        {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    )
    hvd.init()
    hvd.allreduce(tf.constant(1.0))  # training has started
    t0 = time.monotonic()
    closed_after = None
    while time.monotonic() - t0 < 15:
        if not _open(addr, port):
            closed_after = time.monotonic() - t0
            break
        time.sleep(0.1)
    hvd.allreduce(tf.constant(1.0))  # the ranks still train together once it is closed
    return {"open_before": open_before, "listening": listening, "closed_after": closed_after, "addr": addr}


def test_the_rendezvous_is_bound_to_the_task_address_and_closed_once_every_rank_is_initialized(spark):
    results = hvd_spark.run(rendezvous_life, num_proc=2, spark=spark, verbose=0)
    for r in results:
        assert r["open_before"] is True  # the probe reaches a real server while the ranks start
        assert r["closed_after"] is not None, "the rendezvous was still open 15 s into training"
    assert results[0]["listening"] == [results[0]["addr"]]  # the task's address, not 0.0.0.0
    print(f"rendezvous closed {max(r['closed_after'] for r in results):.2f} s after the first allreduce")


def dynamic_process_set():
    import time

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    time.sleep(2)  # long after every rank's init: a closed rendezvous would fail the next call
    subset = hvd.add_process_set([0])  # every rank registers it; its members rendezvous again
    out = None
    if hvd.rank() == 0:
        out = hvd.allreduce(tf.constant([5.0]), op=hvd.Sum, process_set=subset).numpy().tolist()
    hvd.allreduce(tf.constant(1.0))  # rank 1 stays until rank 0 is done with the subset
    return out


def test_dynamic_process_sets_keep_the_rendezvous_open(spark):
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    assert hvd_spark.run(dynamic_process_set, num_proc=2, spark=spark, verbose=0, env=env) == [[5.0], None]


def intruder():
    """Rank 1 connects to the driver service with a wrong token, then with none, and sends what would
    end or fail the job; rank 0 checks that nothing came back. Both then finish normally."""
    import time

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    host, port = os.environ["HVD_SPARK_DRIVER_ADDR"].rsplit(":", 1)
    answers = []
    if hvd.rank() == 1:
        forged = [
            {"t": "fail", "rank": 0, "type": "Forged", "message": "forged failure"},
            {"t": "done", "rank": 0, "ok": True},
            {"t": "gather", "round": "hosts", "info": {}},
            {"t": "log", "rank": 0, "line": "forged line"},
        ]
        for hello in ({"t": "hello", "token": "0" * 32, "role": "task", "partition": 0}, None):
            s = socket.create_connection((host, int(port)), timeout=5)
            lines = ([hello] if hello else []) + forged
            s.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in lines))
            s.settimeout(5)
            try:
                answers.append(s.recv(4096).decode())  # b"" once the service drops the connection
            except TimeoutError:
                answers.append("<no answer, connection still open>")
            s.close()
    time.sleep(1)
    value = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy().tolist()
    return {"answers": answers, "sum": value}


def test_the_driver_service_gives_nothing_to_a_connection_without_the_token(spark, caplog):
    results = hvd_spark.run(intruder, num_proc=2, spark=spark, verbose=0)
    assert [r["sum"] for r in results] == [[3.0], [3.0]]  # the job finished: the forged failure changed nothing
    assert results[1]["answers"] == ["", ""]  # both connections were closed without a byte
    assert "forged" not in caplog.text
