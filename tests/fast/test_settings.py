"""Settings, logging control and the task's child processes: no Spark, no TensorFlow."""

import contextlib
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from hvd_spark._internal.common import logs, settings

ROOT = pathlib.Path(__file__).resolve().parents[2]


# --- settings ---------------------------------------------------------------------------------


def test_precedence_is_argument_then_environment_then_conf_then_default(monkeypatch):
    s = settings.START_TIMEOUT
    monkeypatch.delenv(s.env, raising=False)
    conf = {s.conf: "300"}
    assert s.get() == 600.0
    assert s.get(conf=conf) == 300.0
    monkeypatch.setenv(s.env, "200")
    assert s.get(conf=conf) == 200.0
    assert s.get(100, conf=conf) == 100.0
    assert s.get(100, env={}, conf=conf) == 100.0
    assert s.get(env={}, conf=conf) == 300.0  # an explicit environment replaces the process's
    monkeypatch.setenv(s.env, " ")  # blank: not set
    assert s.get(conf=conf) == 300.0


def test_each_source_names_itself_in_an_error(monkeypatch):
    s = settings.START_TIMEOUT
    monkeypatch.delenv(s.env, raising=False)
    with pytest.raises(ValueError, match=r"start_timeout must be a number of seconds\. Received: 'soon'"):
        s.get("soon")
    with pytest.raises(ValueError, match=r"spark\.hvd_spark\.startTimeout must be greater than 0 seconds"):
        s.get(conf={s.conf: "-1"})
    monkeypatch.setenv(s.env, "x")
    with pytest.raises(ValueError, match=r"HVD_SPARK_START_TIMEOUT must be a number of seconds"):
        s.get(conf={s.conf: "5"})
    with pytest.raises(ValueError, match="must be a number of seconds"):
        settings.parse_seconds("t", True)  # a boolean is not a number of seconds


def test_one_way_to_write_a_boolean(monkeypatch):
    for text, value in (("1", True), ("ON", True), (" yes ", True), ("true", True), ("0", False), ("Off", False)):
        assert settings.parse_bool("X", text) is value
    with pytest.raises(ValueError, match=r"X must be one of \['0', '1', 'false', 'no', 'off', 'on', 'true', 'yes'\]"):
        settings.parse_bool("X", "enabled")
    monkeypatch.setenv("HVD_SPARK_PROGRESS", "2")
    with pytest.raises(ValueError, match="HVD_SPARK_PROGRESS must be one of"):
        settings.PROGRESS.get()  # the progress bar's switch goes through the same parser


def test_counts_and_stall_timeouts(monkeypatch):
    assert settings.MAX_FILES.get(env={"HVD_SPARK_MAX_FILES": "12"}) == 12
    for bad in ("1.5", "0", "many"):
        with pytest.raises(ValueError, match="HVD_SPARK_MAX_FILES must be a positive integer"):
            settings.MAX_FILES.get(env={"HVD_SPARK_MAX_FILES": bad})
    monkeypatch.delenv("HVD_SPARK_STALL_TIMEOUT", raising=False)
    assert settings.stall_timeout_setting(None, 300.0) == 300.0
    assert settings.stall_timeout_setting(None, None) is None
    assert settings.stall_timeout_setting(0, 300.0) is None  # 0: off, even over a default
    assert settings.stall_timeout_setting(None, 300.0, conf={"spark.hvd_spark.stallTimeout": "0"}) is None
    monkeypatch.setenv("HVD_SPARK_STALL_TIMEOUT", "20")
    assert settings.stall_timeout_setting(None, 300.0, conf={"spark.hvd_spark.stallTimeout": "0"}) == 20.0
    assert settings.stall_timeout_setting(8, 300.0) == 8.0
    with pytest.raises(ValueError, match=r"stall_timeout must be 0 \(no stall watchdog\) or at least 5 seconds"):
        settings.stall_timeout_setting(2, None)
    with pytest.raises(ValueError, match="stall_timeout must be a number of seconds"):
        settings.stall_timeout_setting(True, None)


def test_declarations_are_well_formed():
    names = [s.name for s in settings.SETTINGS] + [f.name for f in settings.FIXED]
    envs = [s.env for s in settings.SETTINGS] + [i.env for i in settings.INTERNAL]
    confs = [s.conf for s in settings.SETTINGS if s.conf]
    assert len(set(names)) == len(names) and len(set(envs)) == len(envs) and len(set(confs)) == len(confs)
    for s in settings.SETTINGS:
        assert s.doc and s.doc.endswith("."), s.name
        if s.default is not None:
            assert s.get(env={}) == s.parse("default", s.default), s.name  # the default parses as its type
    with pytest.raises(ValueError, match="conf must start with spark.hvd_spark."):
        settings.Setting("x", "HVD_SPARK_X", "spark.other.x", "seconds", 1.0, ("driver",), "X.")
    with pytest.raises(ValueError, match="a Spark conf key is only read on the driver"):
        settings.Setting("x", "HVD_SPARK_X", "spark.hvd_spark.x", "seconds", 1.0, ("task",), "X.")


def test_every_hvd_spark_variable_in_the_code_is_declared():
    """A HVD_SPARK_* name or spark.hvd_spark.* conf key in the package (code or docstring) must be
    declared: a setting or an internal variable."""
    declared = {s.env for s in settings.SETTINGS} | {i.env for i in settings.INTERNAL}
    declared |= {s.conf for s in settings.SETTINGS if s.conf}
    found: dict[str, set[str]] = {}
    for path in (ROOT / "hvd_spark").rglob("*.py"):
        text = path.read_text()
        for name in re.findall(r"HVD_SPARK_[A-Z0-9_]*[A-Z0-9]|spark\.hvd_spark\.\w+", text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    undeclared = {n: sorted(p) for n, p in found.items() if n not in declared}
    assert not undeclared, f"declare these in common/settings.py: {undeclared}"


def test_the_docs_table_is_the_declarations():
    text = (ROOT / "docs" / "settings.md").read_text()
    match = re.search(r"<!-- settings:begin -->\n(.*)<!-- settings:end -->", text, re.S)
    assert match, "docs/settings.md lost its settings:begin / settings:end markers"
    assert match.group(1) == settings.markdown_table(), (
        "docs/settings.md differs from common/settings.py: paste the output of "
        "python -c 'from hvd_spark._internal.common import settings; print(settings.markdown_table())'"
    )
    for s in settings.SETTINGS:
        assert f"`{s.env}`" in match.group(1)


# --- warm: the explicit argument wins over HVD_SPARK_WARM ----------------------------------------


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _ConnectSession:
    """Looks like a Spark Connect session to the launcher's option checks (a conf, nothing else)."""

    session_id = "fake"

    def __init__(self, conf):
        self.conf = _Conf({"spark.master": "spark://h:7077", "spark.default.parallelism": "8", **conf})


_ConnectSession.__module__ = "pyspark.sql.connect.session"


def test_the_launch_decides_warm_with_the_argument_first(monkeypatch):
    from hvd_spark._internal.driver.options import resolve_launch_options

    def warm(arg=None, env=None, **conf):
        return resolve_launch_options(_ConnectSession(conf), num_proc=2, warm=arg, env=env).warm

    monkeypatch.delenv("HVD_SPARK_WARM", raising=False)
    assert warm() is True
    assert warm(**{"spark.hvd_spark.warm": "0"}) is False
    monkeypatch.setenv("HVD_SPARK_WARM", "0")
    assert warm() is False
    assert warm(True) is True
    assert warm(True, env={"HVD_SPARK_WARM": "0"}) is True
    assert warm(env={"HVD_SPARK_WARM": "1"}) is True  # a job's env is on top of the driver's environment
    monkeypatch.setenv("HVD_SPARK_WARM", "1")
    assert warm(False) is False
    assert warm(env={"HVD_SPARK_WARM": "0"}, **{"spark.hvd_spark.warm": "1"}) is False


def test_a_task_told_to_start_warm_ranks_does_so_whatever_its_environment_says(monkeypatch, tmp_path):
    """The task follows the driver's decision: with HVD_SPARK_WARM=0 in the task's environment, a
    job launched with warm=True still asks the warm server for its rank."""
    from hvd_spark._internal.task import warm
    from hvd_spark._internal.task.barrier import RANK

    asked = []

    def ensure_server(env, app=""):
        asked.append(env["HVD_SPARK_WARM"])
        raise OSError("no server in this test")

    monkeypatch.setattr(warm, "ensure_server", ensure_server)
    assert warm.spawn(RANK, {"HVD_SPARK_WARM": "0"}, str(tmp_path), "app", timeout=1.0) is None  # fell back to fresh
    assert asked == ["0"]


# --- logging: the application keeps control -----------------------------------------------------


@contextlib.contextmanager
def _clean_logging():
    """No handlers on the root logger (pytest adds its own for each test) and none on hvd_spark,
    root at Python's default level: an application that configured nothing. Restored after."""
    root, ours = logging.getLogger(), logging.getLogger("hvd_spark")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.level)
    root.handlers, ours.handlers = [], []
    root.setLevel(logging.WARNING)
    ours.setLevel(logging.NOTSET)
    try:
        yield root, ours
    finally:
        root.handlers, ours.handlers = saved[0], saved[2]
        root.setLevel(saved[1])
        ours.setLevel(saved[3])


def test_progress_shows_when_the_application_configured_no_logging(capsys):
    with _clean_logging() as (_, ours):
        logs.ensure_visible(0)
        assert ours.handlers == [] and ours.level == logging.NOTSET  # verbose=0: nothing
        logs.ensure_visible(1)
        logs.ensure_visible(1)  # once
        assert len(ours.handlers) == 1 and ours.level == logging.INFO
        logging.getLogger("hvd_spark._internal.driver.launcher").info("module loggers are under hvd_spark")
    assert "hvd_spark._internal.driver.launcher: module loggers are under hvd_spark" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["root handler", "root level", "hvd_spark level", "hvd_spark handler"])
def test_an_application_that_configured_logging_keeps_control(how):
    with _clean_logging() as (root, ours):
        app_handler = logging.NullHandler()
        if how == "root handler":
            root.addHandler(app_handler)
        elif how == "root level":
            root.setLevel(logging.ERROR)
        elif how == "hvd_spark level":
            ours.setLevel(logging.ERROR)
        else:
            ours.addHandler(app_handler)
        before = (root.handlers[:], root.level, ours.handlers[:], ours.level)
        logs.ensure_visible(2)
        assert (root.handlers, root.level, ours.handlers, ours.level) == before


def test_logging_configured_after_a_first_fit_takes_over():
    with _clean_logging() as (root, ours):
        logs.ensure_visible(1)
        assert ours.handlers and ours.level == logging.INFO
        root.addHandler(logging.NullHandler())  # the application calls logging.basicConfig() later
        logs.ensure_visible(1)
        assert ours.handlers == [] and ours.level == logging.NOTSET


def test_module_loggers_are_named_after_their_module():
    for path in (ROOT / "hvd_spark").rglob("*.py"):
        for name in re.findall(r"getLogger\(([^)]*)\)", path.read_text()):
            assert name in ("__name__", '"hvd_spark"', '"hvd_spark.rank"', ""), f"{path}: getLogger({name})"


# --- child processes: no preexec_fn, and they die with their task ------------------------------


def test_no_preexec_fn_in_the_package():
    users = [str(p) for p in (ROOT / "hvd_spark").rglob("*.py") if "preexec_fn=" in p.read_text()]
    assert not users, f"preexec_fn is unsafe in a task's multi-threaded process: {users}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_runs_its_command_in_its_own_session():
    from hvd_spark._internal.task.procs import popen_args

    out = subprocess.run(
        **popen_args([sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid(), os.getppid())"]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out == ["True", str(os.getpid())]  # exec'd in place: the wrapper is not a process of its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_is_gone_does_not_run():
    from hvd_spark._internal.task.procs import with_parent

    cmd = with_parent([sys.executable, "-c", "print('ran')"], parent=os.getpid() + 1_000_000)  # not its parent
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 137 and "ran" not in done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_process(tmp_path):
    """A task-like parent with a busy thread starts a child through popen_args and is killed; the
    child (a sleeper) is killed by the kernel with it."""
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(
        f"""
        import subprocess, sys, threading, time
        from hvd_spark._internal.task.procs import popen_args
        threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
        child = subprocess.Popen(**popen_args([sys.executable, "-c", "import time; time.sleep(600)"]))
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT)
    try:
        for _ in range(600):  # up to 60 s for the parent to start its child
            if pid_file.exists() and pid_file.read_text():
                break
            if proc.poll() is not None:
                pytest.fail(f"the parent exited with {proc.returncode}")
            subprocess.run(["sleep", "0.1"], check=True)
        child = int(pid_file.read_text())
        assert _alive(child)
    finally:
        proc.kill()
        proc.wait(30)
    for _ in range(600):  # the kernel signals the child at once; allow up to 60 s for it to be reaped
        if not _alive(child):
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert not _alive(child), "the child outlived its parent"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_the_host_lacks_is_named_with_exit_code_127():
    import subprocess

    from hvd_spark._internal.task.procs import popen_args

    r = subprocess.run(**popen_args(["hvd-spark-no-such-command"]), capture_output=True, text=True, timeout=60)
    assert r.returncode == 127
    assert "cannot run 'hvd-spark-no-such-command' on this host" in r.stderr
    ok = subprocess.run(
        **popen_args(["sh", "-c", "echo $HVD_SPARK_PROBE"]),
        capture_output=True,
        text=True,
        timeout=60,
        env={"HVD_SPARK_PROBE": "kept", "PATH": "/usr/bin:/bin"},
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "kept"  # the environment reaches the command
