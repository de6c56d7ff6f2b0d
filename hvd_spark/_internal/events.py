"""Progress events from a rank's process to the driver (used by the estimator's callbacks)."""

import os
import threading

from hvd_spark._internal import settings
from hvd_spark._internal.driver_service import KIND, Kind

_client = None
_lock = threading.Lock()


def send_event(payload: dict) -> bool:
    """Sends ``payload`` (JSON-serializable) to the driver's ``on_event`` callback.

    Returns False, doing nothing, outside an hvd_spark job or when the driver is unreachable;
    progress must never fail training.
    """
    global _client
    addr = os.environ.get(settings.ENV_DRIVER_ADDR)
    token = os.environ.get(settings.ENV_JOB_TOKEN)
    if not addr or not token:
        return False
    rank = int(os.environ.get(settings.ENV_RANK, "-1"))
    with _lock:
        if _client is None:
            try:
                from hvd_spark._internal.driver_service import TaskClient

                _client = TaskClient(addr, token, {"role": "rank", "rank": rank}, timeout=10)
            except OSError:
                return False
        return _client.send({KIND: Kind.EVENT, "rank": rank, "payload": payload})
