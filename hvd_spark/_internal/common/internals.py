"""Every use of another library's private or undocumented internals, one function each.

Keras, Horovod and Spark offer no public way to do a few things hvd_spark needs: average gradients
inside Keras' optimizer update, compute BatchNormalization's batch statistics over all ranks, reach
Keras' global seed generator, run Horovod's Gloo rendezvous server,
count Spark's barrier task slots, read a plan's explain text without printing it. Each such use
lives here, behind one function, and nowhere else. Every function:

- compares the library's version with :data:`VERIFIED`, the ``(major, minor)`` range its hooks were
  tested on, and logs a warning once per library outside it;
- raises :class:`InternalsChangedError` when the internal it needs is gone, and, where its effect
  would otherwise silently disappear (gradients not averaged, statistics not synchronized, every
  rank drawing the same random numbers), when the hook did not take effect.

``tests/test_internals.py`` checks every hook's presence, signature and effect: run it after
upgrading Keras, Horovod or pyspark, then widen :data:`VERIFIED`.

The libraries are imported inside the functions, so this module loads nothing heavy and every
package may use it.

Private names used elsewhere, because they are pyspark.ml's API for ``Params`` subclasses (what
pyspark's own estimators use): ``Params._dummy()`` (ml/params.py), ``_set`` / ``_setDefault`` /
``_paramMap`` / ``_resetUid`` (ml/estimator.py, ml/params.py, ml/persistence.py,
ml/transformer.py), ``_input_kwargs`` set by ``pyspark.keyword_only`` (ml/estimator.py) and
``MLWriter._handleOverwrite`` (ml/persistence.py). ``tests/test_internals.py`` checks that they
still exist.
"""

import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hvd_spark.errors import HvdSparkError

logger = logging.getLogger(__name__)

# library -> the (major, minor) versions, both ends included, the hooks below were tested on
VERIFIED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "keras": ((3, 15), (3, 15)),
    "horovod": ((0, 28), (0, 28)),
    "pyspark": ((3, 5), (4, 3)),
}
_warned: set[str] = set()


class InternalsChangedError(HvdSparkError):
    """A private part of Keras, Horovod or pyspark that hvd_spark relies on is gone or changed."""


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``3.15.1`` or ``0.28.1+local``."""
    m = re.match(r"(\d+)\.(\d+)", str(text))
    if not m:
        raise ValueError(f"a version must start with 'major.minor'. Received: {text!r}.")
    return int(m.group(1)), int(m.group(2))


def _version(library: str) -> str | None:
    """The version of ``library`` if this process has loaded it (never imports it)."""
    version = getattr(sys.modules.get(library), "__version__", None)
    return None if version is None else str(version)


def check_version(library: str, version: str | None = None) -> bool:
    """Whether ``library``'s version (the loaded one unless ``version`` is given) lies in the range
    its hooks were verified on; outside it, logs a warning (once per library and process). A library
    that is not loaded has nothing to check: True."""
    low, high = VERIFIED[library]
    version = version or _version(library)
    if version is None:
        return True
    ok = low <= parse_version(version) <= high
    if not ok and library not in _warned:
        _warned.add(library)
        logger.warning(
            "hvd_spark relies on private parts of %s that were verified on versions %d.%d to %d.%d; this is %s. "
            "Its checks raise InternalsChangedError if one of them changed (tests/test_internals.py checks them all).",
            library,
            *low,
            *high,
            version,
        )
    return ok


def _changed(library: str, what: str, consequence: str) -> InternalsChangedError:
    low, high = VERIFIED[library]
    return InternalsChangedError(
        f"{what} (a private part of {library}) is not as hvd_spark expects in {library} "
        f"{_version(library) or '(version unknown)'}; "
        f"{consequence}. It was verified on {library} {low[0]}.{low[1]} to {high[0]}.{high[1]}: install a "
        "version in that range, or report this to hvd_spark."
    )


def _require_method(cls: type, name: str, params: Sequence[str], library: str, consequence: str) -> None:
    fn = getattr(cls, name, None)
    if not callable(fn):
        raise _changed(library, f"{cls.__qualname__}.{name}", consequence)
    # The hooks call positionally: any signature that takes these arguments so will do (another name,
    # a default, *args), as a user's subclass may write it.
    signature = inspect.signature(fn)
    try:
        signature.bind(*params)
    except TypeError:
        got = tuple(signature.parameters)
        raise _changed(library, f"{cls.__qualname__}.{name}{got}, expected {tuple(params)}", consequence) from None


# -- Keras ---------------------------------------------------------------------------------------


def distributed_optimizer_class(optimizer, transform: Callable[[list], list]) -> type:
    """A subclass of ``type(optimizer)``, with the same name and module, whose updates pass their
    gradients through ``transform`` (a list with None for variables without a gradient, to a list of
    the same length) before Keras uses them.

    Plain optimizers: through Keras' private ``BaseOptimizer._clip_gradients(grads)``, which ``apply``
    calls once per update after gradient accumulation (on the accumulated average, once per ``N``
    batches) and before clipping and weight decay. The subclass's ``apply`` checks that an update
    went through it. Wrapping optimizers (with an ``inner_optimizer``, e.g. ``LossScaleOptimizer``):
    through their public ``apply(grads, trainable_variables)``, before their own checks.

    Raises:
        InternalsChangedError: the optimizer class has no ``_clip_gradients(self, grads)``, or (from
            the subclass's ``apply``) an update did not pass its gradients through ``transform``.
    """
    check_version("keras")
    base = type(optimizer)
    hooks: dict[str, Any]
    if hasattr(optimizer, "inner_optimizer"):
        consequence = "gradients cannot be averaged over the ranks"
        _require_method(base, "apply", ("self", "grads", "trainable_variables"), "keras", consequence)

        def apply_wrapper(self, grads, trainable_variables=None):
            return base.apply(self, transform(grads), trainable_variables)

        hooks = {"apply": apply_wrapper}
    else:
        consequence = "gradients cannot be averaged over the ranks"
        _require_method(base, "_clip_gradients", ("self", "grads"), "keras", consequence)
        _require_method(base, "apply", ("self", "grads", "trainable_variables"), "keras", consequence)
        passes = [0]  # updates (or traced update branches) whose gradients went through transform

        def _clip_gradients(self, grads):
            passes[0] += 1
            return base._clip_gradients(self, transform(grads))

        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            before, steps_before = passes[0], _steps(self)
            result = base.apply(self, grads, trainable_variables)
            updated = steps_before is None or _steps(self) != steps_before
            if passes[0] == before and updated and any(g is not None for g in grads):
                raise _changed("keras", "Optimizer.apply calling _clip_gradients", "gradients were not averaged")
            return result

        hooks = {"apply": apply, "_clip_gradients": _clip_gradients}
    return type(base.__name__, (base,), {**hooks, "__module__": base.__module__, "__qualname__": base.__qualname__})


def _steps(optimizer) -> int | None:
    """The optimizer's update count (``iterations``: with gradient accumulation, the updates, not the
    batches), or None while tracing a graph, where both branches of Keras' accumulation ``cond`` run
    at trace time, so every traced ``apply`` goes through the hook."""
    import tensorflow as tf

    if not tf.executing_eagerly():
        return None
    return int(optimizer.iterations.numpy())


def compile_loss(model):
    """The ``CompileLoss`` Keras built for a compiled ``model`` (its private ``_compile_loss``), whose
    per-output losses hvd_spark reduces over the global batch (``rank/losses.py``), or None when the
    model was compiled without a loss.

    Raises:
        InternalsChangedError: this Keras keeps its compiled losses elsewhere (no ``_compile_loss`` with
            ``build`` and ``_flat_losses``): masked losses would be normalised per rank, silently.
    """
    check_version("keras")
    if not hasattr(model, "_compile_loss"):
        raise _changed("keras", "Model._compile_loss", "losses cannot be reduced over the global batch")
    loss = model._compile_loss
    if loss is None:
        return None
    if not callable(getattr(loss, "build", None)) or not hasattr(loss, "_flat_losses"):
        raise _changed("keras", "CompileLoss.build / _flat_losses", "losses cannot be reduced over the global batch")
    return loss


def flatten_layers(model) -> list:
    """Every layer inside ``model`` (nested models and layers held by custom layers included), in
    Keras' tracking order, without ``model`` itself (Keras' private ``Layer._flatten_layers``)."""
    check_version("keras")
    walk = getattr(model, "_flatten_layers", None)
    if not callable(walk):
        raise _changed("keras", "Layer._flatten_layers", "the layers inside a model cannot be listed")
    return list(walk(include_self=False, recursive=True))


@functools.cache
def _batch_norm_hook_works() -> bool:
    """Keras' BatchNormalization computes its training statistics through ``self._moments``: a layer
    whose ``_moments`` returns fixed statistics must normalize by them."""
    import numpy as np
    from keras import layers

    layer = layers.BatchNormalization(center=False, scale=False, epsilon=0.0)
    layer.build((None, 2))
    layer._moments = lambda inputs, mask: (np.array([1.0, 1.0], "float32"), np.array([4.0, 4.0], "float32"))
    out = np.asarray(layer(np.array([[3.0, 5.0]], "float32"), training=True))
    return bool(np.allclose(out, [[1.0, 2.0]], atol=1e-4))


def replace_batch_norm_moments(layer, moments: Callable) -> None:
    """Makes the BatchNormalization ``layer`` compute its training statistics with
    ``moments(layer, inputs, mask) -> (mean, variance)`` (Keras' private
    ``BatchNormalization._moments(inputs, mask)``, replaced on this instance only).

    Raises:
        InternalsChangedError: Keras' BatchNormalization no longer has ``_moments(self, inputs, mask)``
            or does not take its statistics from it.
    """
    import types

    from keras import layers

    check_version("keras")
    consequence = "BatchNormalization(synchronized=True) cannot use statistics over all ranks"
    _require_method(layers.BatchNormalization, "_moments", ("self", "inputs", "mask"), "keras", consequence)
    if not _batch_norm_hook_works():
        raise _changed("keras", "BatchNormalization.call using self._moments", consequence)
    layer._moments = types.MethodType(moments, layer)


def batch_norm_reduction_axes(layer) -> list[int]:
    """The axes a built BatchNormalization layer reduces over (Keras' private ``_reduction_axes``)."""
    axes = getattr(layer, "_reduction_axes", None)
    if axes is None:
        raise _changed("keras", "BatchNormalization._reduction_axes", "the layer's batch statistics cannot be computed")
    return list(axes)


def global_seed_generator_state():
    """The state variable of Keras' global seed generator (what ``keras.random`` functions called
    without a seed draw from; Keras' private ``global_state``), or None when none exists yet.

    Raises:
        InternalsChangedError: Keras keeps it elsewhere, so it could not be reseeded per rank.
    """
    check_version("keras")
    try:
        from keras.src.backend.common import global_state
        from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
    except ImportError as e:
        raise _changed(
            "keras", "keras.src.backend.common.global_state", "every rank would draw the same random numbers"
        ) from e
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    return None if generator is None else generator.state


# -- Horovod -------------------------------------------------------------------------------------


def rendezvous_slots(ranks: Sequence[Any]) -> list:
    """Horovod's ``SlotInfo`` records (``horovod.runner``, not public API) for its rendezvous server,
    in rank order, from objects with ``host``, ``rank``, ``local_rank``, ``cross_rank``, ``size``,
    ``local_size`` and ``cross_size``."""
    check_version("horovod")
    try:
        from horovod.runner.common.util.hosts import SlotInfo
    except ImportError as e:
        raise _changed("horovod", "horovod.runner.common.util.hosts.SlotInfo", "the rendezvous cannot start") from e
    return [
        SlotInfo(
            hostname=r.host,
            rank=r.rank,
            local_rank=r.local_rank,
            cross_rank=r.cross_rank,
            size=r.size,
            local_size=r.local_size,
            cross_size=r.cross_size,
        )
        for r in sorted(ranks, key=lambda r: r.rank)
    ]


def rendezvous_server(addr: str):
    """Horovod's Gloo rendezvous HTTP server (``horovod.runner.http``), bound to ``addr`` on a free
    port (``server_address[1]``), not yet serving: call ``serve_forever`` in a thread."""
    check_version("horovod")
    try:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    except ImportError as e:
        raise _changed("horovod", "horovod.runner.http.http_server", "the rendezvous cannot start") from e
    return RendezvousHTTPServer((addr, 0), RendezvousHandler, 0)


def declare_rendezvous_scopes(server, slots: Sequence[Any]) -> None:
    """Tells the rendezvous ``server`` each scope's size (it clears a scope once all its members
    have left it), without emptying its store as its public ``init`` does: a rank may have written
    to it already (Horovod's private ``RendezvousHTTPServer._extract_scope_size``)."""
    _require_method(
        type(server), "_extract_scope_size", ("self", "host_alloc_plan"), "horovod", "the rendezvous cannot start"
    )
    server._extract_scope_size(slots)


def horovod_initialized() -> bool:
    """Whether ``hvd.init()`` has returned in this process, for any framework's Horovod already
    imported; never imports one (safe from a thread while the main thread imports). Reads
    ``is_initialized`` from the modules in ``sys.modules``, which may still be importing."""
    for name in ("horovod.tensorflow", "horovod.torch"):
        probe = getattr(sys.modules.get(name), "is_initialized", None)
        try:
            if probe is not None and probe():
                return True
        except Exception:  # noqa: BLE001 - its library failed to load: another framework may be the one in use
            continue
    return False


# -- Spark (driver side) -------------------------------------------------------------------------


def spark_executor_slots(sc) -> tuple[int, int]:
    """The executors registered with a classic SparkContext and their barrier task slots, as Spark's
    own barrier check counts them (the JVM's ``SparkContext.maxNumConcurrentTasks`` of the default
    resource profile, reached through pyspark's private ``_jsc``)."""
    check_version("pyspark")
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.getExecutorIds().size()), int(jsc.maxNumConcurrentTasks(profile))


def explain_string(df, connect: bool) -> str:
    """``df.explain(extended=True)``'s text without printing it, asked for the way ``explain`` asks:
    Spark Connect's private ``DataFrame._explain_string``, or classic pyspark's ``_sc._jvm``
    ``PythonSQLUtils.explainString`` of the private ``_jdf``."""
    check_version("pyspark")
    if connect:
        return str(df._explain_string(extended=True))
    return str(df._sc._jvm.PythonSQLUtils.explainString(df._jdf.queryExecution(), "extended"))


# -- Spark (its Python UDF workers) -----------------------------------------------------------------


def hide_udf_worker_traceback(error: BaseException) -> None:
    """Makes this Spark Python worker report ``error`` (the one it is about to end the task with) as its
    message alone, without a traceback: pyspark's worker hands a UDF's error to its private
    ``handle_worker_exception``, which takes ``hide_traceback`` (what
    ``spark.sql.execution.pyspark.udf.hideTraceback.enabled`` sets for all errors). Only ``error`` is
    reported so: a reused worker formats any other error as before (setting ``SPARK_HIDE_TRACEBACK``
    instead would hide the tracebacks of the user's own UDFs in every later task of that worker).
    pyspark 3.5's worker has no such parameter: a no-op there."""
    import inspect
    import sys

    check_version("pyspark")
    # the daemon's forked workers run pyspark.worker's main; a worker started alone runs it as __main__
    main = sys.modules.get("__main__")
    candidates = [sys.modules.get("pyspark.worker")]
    if str(getattr(main, "__file__", "")).replace("\\", "/").endswith("pyspark/worker.py"):
        candidates.append(main)
    worker = next((m for m in candidates if hasattr(m, "handle_worker_exception")), None)
    handle = getattr(worker, "handle_worker_exception", None)
    if handle is None:
        return
    original = getattr(handle, "__wrapped__", handle)
    if "hide_traceback" not in inspect.signature(original).parameters:
        return

    def handle_worker_exception(e, outfile, hide_traceback=None):
        if e is error:
            hide_traceback = True
        return original(e, outfile, hide_traceback=hide_traceback)

    handle_worker_exception.__wrapped__ = original  # type: ignore[attr-defined]
    worker.handle_worker_exception = handle_worker_exception  # type: ignore[union-attr]
