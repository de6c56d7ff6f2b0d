"""SIGTERM during a fit or a run (driver/signals.py): the block stops as Ctrl-C stops it (its clean-up
runs), then the process ends with SIGTERM's status; a program's own SIGTERM handler is left alone; the
previous handler is back after the block. Real processes and real signals."""

import signal
import subprocess
import sys
import textwrap
import threading

from hvd_spark._internal.driver.signals import Terminated, ends_on_sigterm, sigterm_as_cancel

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from hvd_spark._internal.driver.signals import sigterm_as_cancel
    if sys.argv[1] == "own":
        signal.signal(signal.SIGTERM, lambda *a: print("own handler", flush=True))
    try:
        with sigterm_as_cancel("the test's block"):
            try:
                print("ready", flush=True)  # inside the try: a SIGTERM right after it is caught too
                time.sleep(60)
            except KeyboardInterrupt as e:
                print("cancelled:", type(e).__name__, flush=True)
                raise
            finally:
                print("clean-up ran", flush=True)
    finally:
        print("after the block", flush=True)
    print("returned", flush=True)
    """
)


def _child(mode: str) -> tuple[int, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", f"the child did not start (exit code {proc.poll()})"
    proc.send_signal(signal.SIGTERM)
    if mode == "own":  # the program's handler only prints: the block goes on; end it
        line = proc.stdout.readline().strip()
        proc.kill()
        return proc.wait(timeout=30), [line]
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out.split("\n")


def test_sigterm_stops_the_block_as_a_cancel_then_ends_the_process_by_sigterm():
    code, lines = _child("default")
    assert lines[:2] == ["cancelled: Terminated", "clean-up ran"]
    assert "returned" not in lines and "after the block" not in lines  # the process ended in the block's exit
    assert code == -signal.SIGTERM  # (a shell's 143)


def test_a_programs_own_sigterm_handler_is_left_alone():
    code, lines = _child("own")
    assert lines == ["own handler"] and code == -signal.SIGKILL


def test_the_previous_handler_is_back_after_the_block_and_other_threads_install_none():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with sigterm_as_cancel("a fit"):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with sigterm_as_cancel("a nested one"):  # the outer block's handler stays
            inner = signal.getsignal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is inner
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    seen = []

    @ends_on_sigterm("a run on a thread")
    def on_a_thread():
        seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join(timeout=30)
    assert seen == [signal.SIG_DFL]
    assert issubclass(Terminated, KeyboardInterrupt)  # every cancel path (except KeyboardInterrupt) takes it
