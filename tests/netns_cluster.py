"""Several Spark "hosts" on one machine: network namespaces on a bridge, one standalone Worker in each.

Used by the ``multihost`` tests (as a context manager) and by hand for examples and benchmarks::

    sudo python tests/netns_cluster.py up --hosts 2 [--hostnames shared|own] [--cores 1]
    # ... spark://10.77.0.1:7077 is printed; drive it from the root namespace with
    # spark.driver.host=10.77.0.1 (hvd_spark.local_session does not set that: pass it in conf)
    sudo python tests/netns_cluster.py down

Layout: a bridge ``hvdbr0`` holding ``10.77.0.1/24`` in the root namespace (the Spark Master and
the driver bind there), and for host ``i`` (2, 3, ...) a namespace ``hvd-h<i>`` whose ``eth0`` (a
veth into the bridge) holds ``10.77.0.<i>``. Every namespace sees the same filesystem, as hosts
sharing an NFS mount would, so a local store path works on every host.

Hostnames, the two set-ups users meet:
- ``shared``: every host keeps this machine's hostname, which ``/etc/hosts`` may map to 127.0.0.1
  (containers, Debian's 127.0.1.1 default). Nothing that resolves the hostname finds the host.
- ``own``: each Worker runs in its own UTS namespace with hostname ``hvd-h<i>``, resolved to its
  address by a per-namespace ``/etc/netns/hvd-h<i>/hosts`` (``ip netns exec`` mounts it over
  ``/etc/hosts``).

Only the addresses of these namespaces and loopback are ever used. Needs root (``ip netns``).
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

BRIDGE = "hvdbr0"
SUBNET = "10.77.0"
MASTER_IP = f"{SUBNET}.1"
MASTER_PORT = 7077
STATE = "/tmp/hvd_spark-netns-cluster.json"


def _ip(*args: str, check: bool = True, tries: int = 1) -> subprocess.CompletedProcess:
    """Runs ``ip ARGS``; with ``tries`` > 1 retries (a namespace just deleted frees its links lazily)."""
    for attempt in range(tries):
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 or not check:
            return r
        if attempt + 1 < tries:
            time.sleep(0.5)
    raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def can_create_namespaces() -> tuple[bool, str]:
    """Whether this process can build the cluster, and why not."""
    if os.geteuid() != 0:
        return False, "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return False, "needs iproute2's `ip`"
    probe = f"hvd-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def host_ip(i: int) -> str:
    return f"{SUBNET}.{i}"


def netns_name(i: int) -> str:
    return f"hvd-h{i}"


@dataclass
class NetnsCluster:
    """A standalone Spark cluster whose Workers live on network-namespace hosts.

    Args:
        hosts: number of worker hosts (namespaces ``hvd-h2`` ... ``hvd-h<hosts+1>``).
        hostnames: ``"shared"`` (this machine's hostname everywhere) or ``"own"`` (one per host).
        cores, memory: what each Worker offers.
        workdir: logs and Spark work folders; a temporary folder by default.
        cpus: pin host ``i``'s Worker (and everything it starts) to CPU ``cpus[i - 2]`` with taskset.
    """

    hosts: int = 2
    hostnames: str = "shared"
    cores: int = 1
    memory: str = "2g"
    workdir: str = ""
    cpus: list[int] | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def master_url(self) -> str:
        return f"spark://{MASTER_IP}:{MASTER_PORT}"

    @property
    def driver_ip(self) -> str:
        return MASTER_IP

    def host_indices(self) -> list[int]:
        return list(range(2, 2 + self.hosts))

    def spark_conf(self) -> dict[str, str]:
        """What a driver in the root namespace needs to use this cluster."""
        return {
            "spark.driver.host": MASTER_IP,
            "spark.driver.bindAddress": MASTER_IP,
            "spark.executor.cores": str(self.cores),
            "spark.cores.max": str(self.cores * self.hosts),
            "spark.executor.memory": "1g",
        }

    # --- network ---
    def _network_up(self) -> None:
        teardown_network()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{MASTER_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i in self.host_indices():
            ns, veth = netns_name(i), f"veth-h{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns, tries=20)
            _ip("link", "set", veth, "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{host_ip(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", MASTER_IP)
            if self.hostnames == "own":
                folder = f"/etc/netns/{ns}"
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "hosts"), "w") as f:
                    f.write(f"127.0.0.1 localhost\n{host_ip(i)} {ns}\n")

    # --- Spark ---
    def _env(self) -> dict[str, str]:
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        return dict(
            os.environ,
            SPARK_HOME=home,
            PYSPARK_PYTHON=sys.executable,
            SPARK_LOG_DIR=os.path.join(self.workdir, "logs"),
            SPARK_NO_DAEMONIZE="1",
        )

    def _spark_class(self) -> str:
        import pyspark

        return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_worker(self, i: int) -> None:
        """Starts (or restarts) host ``i``'s Worker."""
        ns, ip = netns_name(i), host_ip(i)
        env = dict(self._env(), SPARK_LOCAL_IP=ip, SPARK_WORKER_DIR=os.path.join(self.workdir, f"work-h{i}"))
        worker = [
            self._spark_class(),
            "org.apache.spark.deploy.worker.Worker",
            self.master_url,
            "--host",
            ip,
            "--cores",
            str(self.cores),
            "--memory",
            self.memory,
            "--webui-port",
            "8081",
        ]
        argv = ["ip", "netns", "exec", ns]
        if self.hostnames == "own":
            argv += ["unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$0" "$@"']
        if self.cpus:
            argv += ["taskset", "-c", str(self.cpus[(i - 2) % len(self.cpus)])]
        self._start(f"worker-h{i}", argv + worker, env)

    def start(self, timeout: float = 120.0) -> "NetnsCluster":
        ok, why = can_create_namespaces()
        if not ok:
            raise RuntimeError(f"cannot build the namespace cluster: {why}")
        if not self.workdir:
            import tempfile

            self.workdir = tempfile.mkdtemp(prefix="hvd_spark-netns-")
        os.makedirs(self.workdir, exist_ok=True)
        self._network_up()
        env = dict(self._env(), SPARK_LOCAL_IP=MASTER_IP)
        self._start(
            "master",
            [
                self._spark_class(),
                "org.apache.spark.deploy.master.Master",
                "--host",
                MASTER_IP,
                "--port",
                str(MASTER_PORT),
                "--webui-port",
                "8080",
            ],
            env,
        )
        for i in self.host_indices():
            self.start_worker(i)
        self.wait_for_workers(self.hosts, timeout)
        with open(STATE, "w") as f:
            json.dump({"pids": {k: p.pid for k, p in self.procs.items()}, "workdir": self.workdir}, f)
        return self

    def alive_workers(self) -> int:
        """Workers the Master lists as ALIVE (from its JSON status page)."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{MASTER_IP}:8080/json/", timeout=5) as r:
                doc = json.load(r)
        except OSError:
            return 0
        return sum(1 for w in doc.get("workers", []) if w.get("state") == "ALIVE")

    def wait_for_workers(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_workers() < n:
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the namespace cluster did not come up within {timeout:.0f} s "
                    f"({self.alive_workers()} of {n} Workers alive; exited: {dead}); logs in {self.workdir}"
                )
            time.sleep(1)

    def kill_host(self, i: int) -> None:
        """Kills host ``i``'s Worker and everything it started (its executor, Python workers, ranks)."""
        proc = self.procs.get(f"worker-h{i}")
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        kill_in_namespace(netns_name(i))

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs.clear()
        teardown_network()
        with contextlib.suppress(FileNotFoundError):
            os.remove(STATE)

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def kill_in_namespace(ns: str) -> None:
    """SIGKILLs every process whose network namespace is ``ns`` (executors escape process groups)."""
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def teardown_network() -> None:
    """Removes the bridge and every ``hvd-h*`` namespace with whatever still runs in them. Idempotent."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith("hvd-h"):
            kill_in_namespace(ns)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    # Deleting a namespace does not always remove the root end of its veth (seen under gVisor).
    r = _ip("-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith("veth-h"):
            _ip("link", "del", name, check=False)
    _ip("link", "del", BRIDGE, check=False)


def _down() -> None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        with open(STATE) as f:
            state = json.load(f)
        for pid in state.get("pids", {}).values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os.remove(STATE)
    teardown_network()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the bridge, the namespaces, a Master and one Worker per host")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--hostnames", choices=["shared", "own"], default="shared")
    up.add_argument("--cores", type=int, default=1)
    up.add_argument("--memory", default="2g")
    up.add_argument("--workdir", default="")
    up.add_argument("--pin", action="store_true", help="pin host i's Worker to CPU (i - 2) modulo the CPUs")
    sub.add_parser("down", help="stop everything and remove the namespaces and the bridge")
    args = parser.parse_args(argv)
    if args.cmd == "down":
        _down()
        print("namespace cluster removed")
        return 0
    cluster = NetnsCluster(
        hosts=args.hosts,
        hostnames=args.hostnames,
        cores=args.cores,
        memory=args.memory,
        workdir=args.workdir,
        cpus=list(range(os.cpu_count() or 1)) if args.pin else None,
    )
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    # The processes outlive this command (own sessions); `down` stops them.
    cluster.procs.clear()
    print(json.dumps({"master": cluster.master_url, "conf": cluster.spark_conf(), "workdir": cluster.workdir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
