"""Prints which Horovod controllers and tensor operations this installation has.

Run as ``python -m hvd_spark.check_build``; exits non-zero when Horovod's TensorFlow
extension or the Gloo controller is missing (the two things hvd_spark cannot work without).
"""

import sys


def build_report() -> dict:
    """Returns the versions and the Horovod capabilities of this environment."""
    from hvd_spark._internal.common.logs import tf_notices_dropped

    with tf_notices_dropped():  # TF's start-up notices say nothing about the build
        import tensorflow as tf
    import horovod
    import horovod.tensorflow as hvd
    import pyarrow
    import pyspark

    return {
        "horovod": horovod.__version__,
        "tensorflow": tf.__version__,
        "keras": tf.keras.__version__ if hasattr(tf.keras, "__version__") else "?",
        "pyspark": pyspark.__version__,
        "pyarrow": pyarrow.__version__,
        "controllers": {"gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built())},
        "tensor_operations": {
            "nccl": bool(hvd.nccl_built()),
            "ddl": bool(hvd.ddl_built()),
            "ccl": bool(hvd.ccl_built()),
            "mpi": bool(hvd.mpi_built()),
            "gloo": bool(hvd.gloo_built()),
        },
    }


def main() -> int:
    try:
        report = build_report()
    except ImportError as e:
        print(f"hvd_spark check: Horovod's TensorFlow extension did not import: {e}", file=sys.stderr)
        return 1
    print("hvd_spark build check")
    for key in ("horovod", "tensorflow", "keras", "pyspark", "pyarrow"):
        print(f"  {key:<18}{report[key]}")
    ctl = ", ".join(f"[{'X' if v else ' '}] {k}" for k, v in report["controllers"].items())
    ops = ", ".join(f"[{'X' if v else ' '}] {k}" for k, v in report["tensor_operations"].items())
    print(f"  {'controllers':<18}{ctl}")
    print(f"  {'tensor operations':<18}{ops}")
    if not report["controllers"]["gloo"]:
        print("hvd_spark check: Horovod was built without Gloo; rebuild with HOROVOD_WITH_GLOO=1.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
