"""What a task reports of its rank: a rank that failed while the job was being stopped (a timeout or
a stall: its peer was stopped first, so its collective ended with an error) keeps the output it
printed, with the stack it dumped for the driver's report."""

import cloudpickle

from hvd_spark._internal.common.outcomes import ERROR
from hvd_spark._internal.driver.supervisor import _stacks
from hvd_spark._internal.rank.entry import error_outcome
from hvd_spark._internal.task.watch import read_outcome

TAIL = [
    "Stack (most recent call first):",
    '  File "/x/mpi_ops.py", line 9 in allreduce',
    '  File "/x/job.py", line 3 in fn',
]


def _failed(tmp_path):
    exc = RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks")
    (tmp_path / "error-0.pkl").write_bytes(cloudpickle.dumps(error_outcome(0, exc)))


def test_a_rank_that_failed_while_being_stopped_keeps_its_stack(tmp_path):
    _failed(tmp_path)
    out = read_outcome(str(tmp_path), 0, 1, True, TAIL)
    assert out.status == ERROR and "shut down" in out.message
    assert out.tail == tuple(TAIL)
    state, frames = _stacks([out], [0])[0]  # what the driver's timeout or stall report shows for rank 0
    assert frames == ['File "/x/mpi_ops.py", line 9 in allreduce', 'File "/x/job.py", line 3 in fn']


def test_a_rank_that_failed_on_its_own_reports_its_error_alone(tmp_path):
    _failed(tmp_path)
    out = read_outcome(str(tmp_path), 0, 1, False, TAIL)
    assert out.status == ERROR and out.tail == ()
