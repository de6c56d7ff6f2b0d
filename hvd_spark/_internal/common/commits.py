"""The commit API of functions run with ``hvd_spark.run(..., max_restarts=...)``: rank 0 commits a
state (any picklable object), the driver keeps the latest one, and the ranks of the next attempt (after
a failure, on as many slots as there are with ``min_num_proc``) start from it.

A commit travels to the driver as a progress event (``send_event``), so it needs no shared storage
and survives the loss of any rank or host; it is kept in the driver's memory only, for the one
``run`` call. Keep states small (model weights of a small model, counters): each crosses the network
once per commit.
"""

import base64
import os

import cloudpickle

from hvd_spark._internal.common import settings

COMMIT = "commit"  # the event kind of a commit

_state: dict = {}  # "bytes": this process's latest known commit (restored or committed here)


def commit_state(state) -> bool:
    """Records ``state`` as the point the next attempt restarts from (call it on every rank at the same
    points, e.g. after each epoch or every N steps; rank 0's is kept, the others' calls do nothing).

    Returns True when the driver received it (False outside an hvd_spark job: the state is kept in this
    process only)."""
    from hvd_spark._internal.common.events import send_event

    data = cloudpickle.dumps(state)
    _state["bytes"] = data
    if int(os.environ.get(settings.ENV_RANK, "0")) != 0:
        return False
    return send_event({"kind": COMMIT, "state": base64.b64encode(data).decode("ascii")})


def committed_state(default=None):
    """The latest committed state: in a restarted attempt, what rank 0 of an earlier attempt committed
    last; ``default`` when nothing was committed yet."""
    data = _state.get("bytes")
    return cloudpickle.loads(data) if data is not None else default


class Restoring:
    """``fn`` wrapped for an attempt that starts from ``state`` (base64 of the pickled commit, or
    None): the rank's :func:`committed_state` returns it."""

    def __init__(self, fn, state: str | None):
        self.fn, self.state = fn, state

    def __call__(self, *args, **kwargs):
        if self.state is not None:
            _state["bytes"] = base64.b64decode(self.state)
        return self.fn(*args, **kwargs)


class CommitKeeper:
    """The driver's side: an ``on_event`` listener that keeps rank 0's latest commit."""

    def __init__(self, forward=None):
        self.state: str | None = None
        self.commits = 0
        self._forward = forward

    def __call__(self, rank: int, payload: dict) -> None:
        if payload.get("kind") == COMMIT:
            self.state = payload.get("state")
            self.commits += 1
        elif self._forward is not None:
            self._forward(rank, payload)
