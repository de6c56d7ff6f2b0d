"""The fast tier: no Spark, TensorFlow, Keras or Horovod's native parts (a test may compare
against Horovod's pure-Python host assignment, skipped where Horovod is not installed). When only
this tier runs (``bash scripts/test.sh tests/fast``), the session fails if any test pulled one
of them in, so that the tier stays fast and the rule stays true."""

import sys

HEAVY = ("pyspark", "tensorflow", "keras", "horovod.tensorflow", "horovod.common.basics")


def pytest_sessionfinish(session, exitstatus):
    paths = {str(item.path) for item in session.items}
    if not paths or not all("/tests/fast/" in p for p in paths):
        return  # other tiers ran in the same session: they load these on purpose
    loaded = sorted(m for m in HEAVY if m in sys.modules)
    if loaded:
        session.exitstatus = 1
        print(f"\nfast tier: these modules were imported and must not be: {loaded}", file=sys.stderr)
