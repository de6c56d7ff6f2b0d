"""What both ways of running a barrier stage share: the spec every task receives and the stage's
blocking call in a background thread."""

import threading
from collections.abc import Callable

from hvd_spark._internal.common.outcomes import TaskSpec
from hvd_spark._internal.driver.options import LaunchOptions


def task_spec(options: LaunchOptions, payload: bytes, driver_addr: str, token: str) -> TaskSpec:
    from hvd_spark._internal.common.logs import rank_env_defaults

    return TaskSpec(
        driver_addr=driver_addr,
        token=token,
        payload=payload,
        backend=options.backend,
        env=rank_env_defaults(options.env),
        num_threads=int(options.num_threads),
        gloo_timeout=options.gloo_timeout,
        abort_grace=options.abort_grace,
        heartbeat_timeout=options.heartbeat_timeout,
        warm=options.forks_warm,
        warm_set=options.warm_set,
        app=options.app,
        start_timeout=options.start_timeout,
        use_gpu=options.use_gpu,
    )


class Stage:
    """The barrier stage's blocking call, in a background thread; its rows or its error."""

    def __init__(
        self, call: Callable[[], list], name: str, inheritable: bool, on_end: Callable[[], None] | None = None
    ):
        from pyspark import InheritableThread

        self.rows: list | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

        def run():
            try:
                self.rows = call()
            except BaseException as e:  # noqa: BLE001 - the launcher reports it with what it knows
                self.error = e
            finally:
                self._done.set()  # before on_end: a woken loop sees the stage ended
                if on_end is not None:
                    on_end()  # the waiting loop sees the end now, not at its next poll

        self.thread = (InheritableThread if inheritable else threading.Thread)(target=run, name=name)
        self.thread.daemon = True
        self.thread.start()

    def alive(self) -> bool:
        return not self._done.is_set()
