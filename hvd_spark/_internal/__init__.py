"""Implementation of hvd_spark, one package per place where code runs. Nothing here is public API.

- ``common``: pure records, rules and settings that every process shares (no Spark, no TF, no Horovod).
- ``driver``: the Spark driver (or, on Spark Connect, the job's coordinator task): launch a barrier
  job, serve its tasks and ranks, watch it, show progress, track it.
- ``task``: inside a Spark barrier task (Spark's Python worker): rendezvous, start and watch the
  rank's process, warm fork servers, mpirun and its agent.
- ``rank``: inside one rank's own process: the entry point, Keras training with Horovod, the reader.
- ``infer``: prediction in Spark's Python UDF workers (the transformer that asks for it is ``ml``'s).
- ``data``: the store and the data written to it (driver side; no TF).
- ``ml``: the Spark ML front on the driver: the estimator and the transformer, their params, fit planning,
  persistence.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Saved metadata names a class by its defining module (Spark ML's rule), and pickles name classes
# by module too. Saves record ``hvd_spark.HorovodEstimator`` / ``hvd_spark.TFTransformer``; what earlier
# versions saved names the flat module layout they had, and loads through these names: each old module
# is a module of its own holding the names of the modules that took its code.
_SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "hvd_spark._internal.estimator": ("hvd_spark._internal.ml.estimator",),
    "hvd_spark._internal.transformer": ("hvd_spark._internal.ml.transformer",),
    "hvd_spark._internal.store": ("hvd_spark._internal.data.store",),
    # callbacks of hvd_spark.keras in a saved estimator's objects
    "hvd_spark._internal.keras_hvd": (
        "hvd_spark._internal.rank.optimizer",
        "hvd_spark._internal.rank.state",
        "hvd_spark._internal.rank.batchnorm",
        "hvd_spark._internal.rank.callbacks",
    ),
}


class _SavedNameLoader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]):
        self.targets = targets

    def create_module(self, spec):
        return None  # a fresh module: the targets keep their own names and specs

    def exec_module(self, module) -> None:
        for target in self.targets:
            names = vars(importlib.import_module(target))
            module.__dict__.update({k: v for k, v in names.items() if not k.startswith("__")})


class _SavedNameFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _SAVED_NAMES:
            return None
        return importlib.util.spec_from_loader(fullname, _SavedNameLoader(_SAVED_NAMES[fullname]))


if not any(isinstance(f, _SavedNameFinder) for f in sys.meta_path):
    sys.meta_path.append(_SavedNameFinder())
