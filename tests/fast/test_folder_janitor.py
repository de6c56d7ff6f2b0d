"""A task's work folder goes however the task ends: removed by the task itself, or, when its process
is killed (Spark kills a cancelled task's Python worker), by its janitor (``task/procs.py``)."""

import os
import subprocess
import sys
import time

KILLED_TASK = """
import os, signal, sys
from hvd_spark._internal.task.procs import FolderJanitor
path = sys.argv[1]
os.makedirs(os.path.join(path, "tmp"))
with open(os.path.join(path, "tmp", "model.keras"), "wb") as f:
    f.write(b"x" * 1000)
FolderJanitor(path)
os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit
"""


def test_a_killed_task_s_folder_is_removed_by_its_janitor(tmp_path):
    path = tmp_path / "hvd_spark-work"
    proc = subprocess.run([sys.executable, "-c", KILLED_TASK, str(path)], timeout=60)
    assert proc.returncode == -9
    deadline = time.monotonic() + 30
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists(), "the janitor did not remove the killed task's folder within 30 s"


def test_a_task_that_ends_removes_its_folder_and_its_janitor_at_once(tmp_path):
    from hvd_spark._internal.task.procs import FolderJanitor

    path = tmp_path / "hvd_spark-work"
    (path / "tmp").mkdir(parents=True)
    janitor = FolderJanitor(str(path))
    janitor.close()
    assert not path.exists()
    assert janitor._proc.returncode == 0  # reaped: no zombie in a worker Spark reuses
    assert os.path.exists(tmp_path)
