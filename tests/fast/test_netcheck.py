"""The pre-flight check for hosts whose hostname Gloo would bind to loopback (no Spark, no TF)."""

import socket

from hvd_spark._internal.task import netcheck

TWO_HOSTS = ["10.77.0.2", "10.77.0.3"]


def _problem(**kw):
    args = dict(rank=1, ip="10.77.0.3", hosts=TWO_HOSTS, version="0.28.1", hostname="vm", bind_address="127.0.0.1")
    return netcheck.gloo_host_problem(**{**args, **kw})


def test_loopback_hostname_on_a_multi_host_job_is_refused_with_host_rank_and_fix():
    msg = _problem()
    assert msg is not None
    assert "rank 1 on host 10.77.0.3" in msg and "'vm'" in msg and "127.0.0.1" in msg
    assert "map 'vm' to 10.77.0.3 in /etc/hosts" in msg and "0.28.1+hvdspark" in msg
    assert "127.0.1.1" in (_problem(bind_address="127.0.1.1") or "")  # Debian's default mapping
    assert "::1" in (_problem(bind_address="::1") or "")
    assert "does not resolve" in (_problem(bind_address=None) or "")


def test_no_problem_on_one_host_with_the_fixed_build_or_a_routable_hostname():
    assert _problem(hosts=["10.77.0.2", "10.77.0.2"]) is None  # one host: loopback reaches every rank
    assert _problem(version="0.28.1+hvdspark.1") is None
    assert _problem(bind_address="10.77.0.3") is None
    assert netcheck.has_process_set_iface_fix("0.28.1+hvdspark.1")
    assert not netcheck.has_process_set_iface_fix("0.28.1")


def test_bind_address_is_the_first_resolved_address_that_binds():
    infos = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1", 0, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 0)),
    ]

    def resolve(*_):
        return infos

    assert netcheck.hostname_bind_address("h", resolve, can_bind=lambda i: i[3][0] != "fe80::1") == "127.0.1.1"
    assert netcheck.hostname_bind_address("h", resolve, can_bind=lambda i: False) is None

    def fails(*_):
        raise socket.gaierror("Name or service not known")

    assert netcheck.hostname_bind_address("nope", fails) is None
    # The real resolver: localhost binds to a loopback address.
    assert netcheck.hostname_bind_address("localhost") in ("127.0.0.1", "::1")


def test_a_reserved_port_is_given_to_no_one_else_and_torchs_store_listens_on_it():
    """The task holds rank 0's MASTER_PORT from before the exchange until it ends: a bind to port 0
    (with or without SO_REUSEADDR) never gets it, a plain bind to it fails, and a listening socket
    with SO_REUSEADDR, as torch's TCPStore opens (libuv's and c10d's), binds and serves on it."""
    reserved = netcheck.ReservedPort("127.0.0.1")
    assert netcheck.ReservedPort.HELD_FOR_TORCH  # the tests run on Linux
    others = []
    try:
        for reuse in (0, 1) * 500:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
            s.bind(("127.0.0.1", 0))
            others.append(s)
            assert s.getsockname()[1] != reserved.port
        plain = socket.socket()
        try:
            plain.bind(("127.0.0.1", reserved.port))
            raise AssertionError("a plain bind took the reserved port")
        except OSError:
            pass
        finally:
            plain.close()
        store = socket.socket()
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("0.0.0.0", reserved.port))  # TCPStore binds every address
        store.listen()
        with socket.create_connection(("127.0.0.1", reserved.port), timeout=5) as client:
            conn, _ = store.accept()
            client.sendall(b"x")
            assert conn.recv(1) == b"x"
            conn.close()
        store.close()
    finally:
        for s in others:
            s.close()
        reserved.release()
    reserved.release()  # twice: nothing
