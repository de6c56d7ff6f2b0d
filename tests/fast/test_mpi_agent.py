"""mpirun across hosts: the tagged-output splitter, the mpirun command line, and the rsh agent
talking to a host's command server (real sockets and processes; mpirun itself runs in
tests/test_multihost.py)."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

from hvd_spark._internal.common import settings
from hvd_spark._internal.common.topology import assign_ranks
from hvd_spark._internal.task import mpi_agent
from hvd_spark._internal.task.mpi import mpirun_command
from hvd_spark._internal.task.watch import split_tagged


def test_split_tagged_reassembles_pieces_of_several_ranks():
    line = "[1,0]<stdout>:rank[1,1]<stdout>:hel[1,0]<stdout>: 0 done\n"
    assert split_tagged(line, 0) == [(0, "rank"), (1, "hel"), (0, " 0 done\n")]
    assert split_tagged("mpirun: plain message\n", 0) == [(0, "mpirun: plain message\n")]
    assert split_tagged("[1,12]<stderr>:x\n", 0) == [(12, "x\n")]


def test_mpirun_command_lays_out_ranks_per_host_and_uses_the_agent():
    ranks = assign_ranks(["10.0.0.2", "10.0.0.3", "10.0.0.2"])
    cmd = mpirun_command(ranks, {}, "10.0.0.0/24")
    joined = " ".join(cmd)
    assert cmd[:3] == ["mpirun", "-np", "3"]
    assert "-H 10.0.0.2:2,10.0.0.3:1" in joined  # contiguous per host, rank 0's host first
    assert f"plm_rsh_agent {sys.executable} -m hvd_spark._internal.task.mpi_agent" in joined
    assert "oob_tcp_if_include 10.0.0.0/24" in joined and "btl_tcp_if_include 10.0.0.0/24" in joined
    # The user's interface choice wins over the subnet.
    mine = " ".join(mpirun_command(ranks, {"OMPI_MCA_btl_tcp_if_exclude": "docker0"}, "10.0.0.0/24"))
    assert "btl_tcp_if_include" not in mine and "oob_tcp_if_include 10.0.0.0/24" in mine
    # One host: no agent, no host list.
    single = mpirun_command(assign_ranks(["127.0.0.1"] * 2), {}, None)
    assert "-H" not in single and "plm_rsh_agent" not in " ".join(single)


def _agent(host, command, hosts, token):
    env = dict(os.environ, **{mpi_agent.ENV_HOSTS: json.dumps(hosts), settings.ENV_JOB_TOKEN: token})
    return subprocess.Popen(
        [sys.executable, "-m", "hvd_spark._internal.task.mpi_agent", host, *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def server(tmp_path):
    s = mpi_agent.CommandServer("127.0.0.1", "secret", dict(os.environ, ONLY_ON_HOST="yes"), str(tmp_path))
    yield s
    s.stop(0.5)


def test_agent_runs_the_command_on_the_host_with_its_environment_and_exit_code(server, tmp_path):
    proc = _agent("hostB", ["echo", "$ONLY_ON_HOST;", "pwd;", "exit", "3"], {"hostB": server.addr}, "secret")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert out.splitlines() == ["yes", str(tmp_path)]
    assert server.finished.is_set() and server.returncode == 3


def test_agent_with_a_wrong_token_runs_nothing(server):
    proc = _agent("hostB", ["touch", "/tmp/should-not-exist-$$"], {"hostB": server.addr}, "wrong")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 255 and "closed the connection" in out
    assert not server.started.is_set()


def test_agent_names_a_host_that_runs_no_task():
    out = io.StringIO()
    assert mpi_agent.run_remote("hostC", "true", {"hostB": "127.0.0.1:1"}, "t", out=out) == 255
    assert "hostC" in out.getvalue() and "hostB" in out.getvalue()


def test_killing_the_agent_stops_the_command_on_the_host(server, tmp_path):
    pidfile = tmp_path / "pid"
    proc = _agent("h", [f"echo $$ > {pidfile}; exec sleep 300"], {"h": server.addr}, "secret")
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.1)
    proc.kill()  # mpirun gone: its agent dies, the connection drops
    proc.wait()
    assert server.finished.wait(30)
    pid = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def test_stop_kills_running_commands(server, tmp_path):
    proc = _agent("h", ["sleep", "300"], {"h": server.addr}, "secret")
    assert server.started.wait(30)
    server.stop(0.5)
    proc.communicate(timeout=30)
    assert server.finished.wait(30) and server.returncode is not None and server.returncode < 0


def test_rank_0s_task_exports_torchs_rendezvous_and_the_ranks_per_host_to_every_rank():
    from hvd_spark._internal.task.mpi import TORCH_EXPORTS, torch_exports

    ranks = assign_ranks(["10.0.0.2", "10.0.0.3", "10.0.0.2"])
    exports = torch_exports(ranks, "10.0.0.2", 41000, "hvd_spark-r")
    assert exports == {
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "41000",
        "TORCHELASTIC_RUN_ID": "hvd_spark-r",
        settings.ENV_NODE_SIZES: "2,1",
    }
    assert set(exports) == set(TORCH_EXPORTS)
    cmd = mpirun_command(ranks, exports, "10.0.0.0/24", TORCH_EXPORTS)
    entry = cmd.index(sys.executable)
    flags = cmd[cmd.index("--tag-output") + 1 : entry]
    assert flags == [x for name in TORCH_EXPORTS for x in ("-x", name)]  # remote ranks get them too
