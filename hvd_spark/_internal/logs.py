"""Makes hvd_spark's progress visible to a person when the application configured no logging."""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def ensure_visible(verbose: int) -> None:
    """With ``verbose`` >= 1 and no handler anywhere up the tree, logs hvd_spark at INFO to stderr.

    An application that configured logging (a handler on the root logger or on ``hvd_spark``)
    keeps full control; nothing is added then.
    """
    logger = logging.getLogger("hvd_spark")
    if not verbose:
        return
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
