"""Checks, before any rank starts, that ranks on different hosts will be able to reach each other.

Horovod 0.28.1 gives each process set (the global one included) a Gloo device of its own, and
that device ignores ``HOROVOD_GLOO_IFACE``: it binds to the first address that this machine's
hostname resolves to. Where ``/etc/hosts`` maps the hostname to loopback (containers, Debian's
``127.0.1.1`` default) or the hostname does not resolve, ranks on other hosts get a loopback
address to connect to and ``hvd.init()`` aborts with ``connect [127.0.0.1]:...: Connection
refused``. hvd_spark's build of Horovod (``scripts/setup.sh``, version ``0.28.1+hvdspark.N``)
fixes the device to use the job's interface; with any other build this check names the host and
the fix instead of letting the ranks abort. Pure stdlib: runs in the barrier task.

Also the port a task holds for torch.distributed's ``TCPStore`` (:class:`ReservedPort`).
"""

import ipaddress
import socket
import sys
from collections.abc import Callable, Sequence

# The local version label of hvd_spark's patched Horovod build (scripts/setup.sh).
PATCHED_LABEL = "+hvdspark."


def horovod_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return ""


def has_process_set_iface_fix(version: str) -> bool:
    """Whether this Horovod build binds process-set devices to ``HOROVOD_GLOO_IFACE``."""
    return PATCHED_LABEL in version


def hostname_bind_address(
    hostname: str,
    resolve: Callable[..., list] = socket.getaddrinfo,
    can_bind: Callable[[tuple], bool] | None = None,
) -> str | None:
    """The address Gloo binds to when all it has is ``hostname``: the first address that
    ``getaddrinfo`` gives for it and that a socket can bind; None when there is none."""
    try:
        infos = resolve(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        return None
    bind = can_bind or _can_bind
    for family, socktype, proto, _, sockaddr in infos:
        if bind((family, socktype, proto, sockaddr)):
            return str(sockaddr[0])
    return None


def _can_bind(info: tuple) -> bool:
    family, socktype, proto, sockaddr = info
    try:
        with socket.socket(family, socktype, proto) as s:
            s.bind((sockaddr[0], 0, *sockaddr[2:]) if family == socket.AF_INET6 else (sockaddr[0], 0))
        return True
    except OSError:
        return False


def gloo_host_problem(
    *,
    rank: int,
    ip: str,
    hosts: Sequence[str],
    version: str,
    hostname: str,
    bind_address: str | None,
) -> str | None:
    """Why ranks on other hosts could not reach this one over Gloo, or None when they can.

    Args:
        rank: this task's rank (for the message).
        ip: the address this task reaches the driver from (the host's address in the job).
        hosts: every task's host address.
        version: the installed Horovod version.
        hostname: this machine's hostname.
        bind_address: what ``hostname`` binds to (:func:`hostname_bind_address`); None or "" for nothing.
    """
    if len(set(hosts)) < 2 or has_process_set_iface_fix(version):
        return None
    if not bind_address:
        what = "does not resolve to an address that can be bound"
    elif ipaddress.ip_address(bind_address.split("%")[0]).is_loopback:
        what = f"resolves to {bind_address}, a loopback address"
    else:
        return None
    return (
        f"rank {rank} on host {ip}: this machine's hostname {hostname!r} {what}. Horovod {version or '?'} "
        f"binds the Gloo connections of its process sets to the hostname's address (it ignores "
        f"HOROVOD_GLOO_IFACE there), so ranks on the other {len(set(hosts)) - 1} host(s) could not connect "
        f"and hvd.init() would abort. Fix one of: install Horovod with hvd_spark's build (scripts/setup.sh, "
        f"version 0.28.1+hvdspark.N), or map {hostname!r} to {ip} in /etc/hosts on that host."
    )


class ReservedPort:
    """A free TCP port on the task's address, held for rank 0's ``TCPStore`` (``MASTER_PORT``) from
    before the exchange of host infos until the task ends: bound with ``SO_REUSEADDR`` and never
    listening. On Linux no other socket is given it meanwhile (a ``bind`` to port 0 or a ``connect``
    passes over a port that has a bound socket), and ``TCPStore``'s own socket (``SO_REUSEADDR``, from
    libuv or c10d) binds and listens on it all the same: there is no window. Elsewhere (BSD rules: a
    second bind to a held port fails) the task frees it just before its rank starts."""

    HELD_FOR_TORCH = sys.platform.startswith("linux")

    def __init__(self, addr: str):
        self._sock: socket.socket | None = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, 0))
        self.port: int = self._sock.getsockname()[1]

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
