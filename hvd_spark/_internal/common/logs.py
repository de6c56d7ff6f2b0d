"""Makes hvd_spark's progress visible to a person when the application configured no logging.

Every module logs to ``logging.getLogger(__name__)`` (``hvd_spark._internal.<package>.<module>``),
all under the ``hvd_spark`` logger, so ``logging.getLogger("hvd_spark").setLevel(...)`` governs
them all; the ranks' output lines go to ``hvd_spark.rank``."""

import contextlib
import logging
import os
import re
import sys
import threading

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_OURS = "_hvd_spark_visible"  # marks the handler ensure_visible adds


def _own_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger("hvd_spark").handlers if getattr(h, _OURS, False)]


def app_configured_logging() -> bool:
    """Whether the application configured logging: a handler on the root logger or on ``hvd_spark``,
    a level on ``hvd_spark``, or a root level other than Python's default (WARNING). What
    :func:`ensure_visible` itself set does not count."""
    root, ours = logging.getLogger(), logging.getLogger("hvd_spark")
    own = _own_handlers()
    app_handlers = [h for h in ours.handlers if h not in own]
    app_level = ours.level != logging.NOTSET and not own  # with our handler, the level is ours too
    return bool(root.handlers or app_handlers or app_level or root.level != logging.WARNING)


def ensure_visible(verbose: int) -> None:
    """With ``verbose`` >= 1 in an application that configured no logging, logs hvd_spark (every
    module's logger is under ``hvd_spark``) at INFO to stderr.

    An application that configured logging (:func:`app_configured_logging`) keeps full control: no
    handler and no level is set then, and those set by an earlier call (before the application
    configured logging) are removed, so its own levels and handlers decide what is shown.
    """
    logger = logging.getLogger("hvd_spark")
    own = _own_handlers()
    if app_configured_logging():
        for h in own:
            logger.removeHandler(h)
        if own:
            logger.setLevel(logging.NOTSET)
        return
    if verbose and not own:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        setattr(handler, _OURS, True)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
DEFAULT_TF_LOG_LEVEL = "2"  # ranks: TF's C++ INFO and WARNING lines off unless the user says otherwise

# TensorFlow's C++ INFO lines (absl format) and the notices it prints before its logging is set up,
# which TF_CPP_MIN_LOG_LEVEL does not silence.
_ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./+-]+:\d+\] ")
_PRE_INIT = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",  # the second line of cpu_feature_guard's INFO notice
)


def rank_env_defaults(env: dict[str, str] | None) -> dict[str, str]:
    """The ranks' environment with TF's C++ logging quiet by default: the user's own setting (in
    ``env``, else in the driver's environment, which a cluster does not pass on) wins."""
    out = dict(env or {})
    out.setdefault(TF_LOG_LEVEL, os.environ.get(TF_LOG_LEVEL) or DEFAULT_TF_LOG_LEVEL)
    return out


def tf_quiet(env: dict[str, str]) -> bool:
    """Whether the ranks asked TF for no INFO lines (then its pre-setup notices are dropped too)."""
    try:
        return int(env.get(TF_LOG_LEVEL, "0")) >= 1
    except ValueError:
        return False


def is_tf_notice(line: str) -> bool:
    """A TF C++ INFO line or pre-setup notice (kept in a failed rank's last lines, not sent to the log)."""
    return line.startswith(_PRE_INIT) or bool(_ABSL_INFO.match(line))


@contextlib.contextmanager
def tf_notices_dropped():
    """Drops TensorFlow's C++ start-up notices (written to fd 2 whatever TF_CPP_MIN_LOG_LEVEL says)
    while the body imports TF, in a process that is not a rank: transform's Python workers, whose
    stderr is the executor's log (the driver's console in local mode). Other lines pass through.
    Quiet like the ranks: unless TF_CPP_MIN_LOG_LEVEL is 0, or TF was already imported."""
    if "tensorflow" in sys.modules or not tf_quiet({TF_LOG_LEVEL: os.environ.get(TF_LOG_LEVEL, DEFAULT_TF_LOG_LEVEL)}):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    captured: list[bytes] = []

    def drain():
        while chunk := os.read(read_end, 65536):
            captured.append(chunk)

    reader = threading.Thread(target=drain, name="hvd_spark-tf-notices", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees EOF
        os.close(saved)
        reader.join(timeout=5)
        os.close(read_end)
        kept = [
            line
            for line in b"".join(captured).decode("utf-8", "replace").splitlines(keepends=True)
            if not is_tf_notice(line)
        ]
        if kept:
            os.write(2, "".join(kept).encode())
