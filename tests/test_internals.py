"""Each private part of Keras, Horovod and pyspark that hvd_spark uses (hvd_spark/_internal/common/
internals.py) still exists with the expected signature and still has its effect. A new Keras,
Horovod or pyspark that changes one fails here, naming it. Keras and Horovod run in this process or
in two small rank processes over Gloo (no Spark); the two Spark hooks use the local session."""

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hvd_spark._internal.common import internals
from hvd_spark._internal.common.internals import InternalsChangedError

keras = pytest.importorskip("keras")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- version checks ------------------------------------------------------------------------------


def test_the_installed_versions_are_the_verified_ones():
    import horovod
    import pyspark

    for module in (keras, horovod, pyspark):
        assert internals.check_version(module.__name__), f"{module.__name__} {module.__version__} is outside VERIFIED"


def test_a_version_outside_the_verified_range_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(internals, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        assert internals.check_version("keras", "3.99.0") is False
        assert internals.check_version("keras", "3.99.0") is False
    warnings = [r for r in caplog.records if "verified on versions 3.15 to 3.15; this is 3.99.0" in r.getMessage()]
    assert len(warnings) == 1
    assert internals.parse_version("0.28.1+hvdspark.1") == (0, 28)
    with pytest.raises(ValueError, match="major.minor"):
        internals.parse_version("nightly")


# -- Keras: the optimizer's gradient hook --------------------------------------------------------


def _doubled(grads):
    return [None if g is None else g * 2.0 for g in grads]


def test_keras_optimizer_internals_have_the_expected_signatures():
    base = keras.optimizers.Optimizer
    assert _params(base._clip_gradients) == ["self", "grads"]
    assert _params(base.apply)[:3] == ["self", "grads", "trainable_variables"]
    assert _params(keras.optimizers.LossScaleOptimizer.apply)[:3] == ["self", "grads", "trainable_variables"]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_the_optimizer_hook_transforms_the_gradients_of_every_update(traced):
    import tensorflow as tf

    opt = keras.optimizers.SGD(learning_rate=1.0)
    cls = internals.distributed_optimizer_class(opt, _doubled)
    assert (cls.__name__, cls.__module__) == ("SGD", type(opt).__module__) and issubclass(cls, type(opt))
    opt.__class__ = cls
    w = keras.Variable(np.array([1.0, 1.0], "float32"))
    opt.build([w])

    def step(g):
        opt.apply([g], [w])

    run = tf.function(step) if traced else step
    run(tf.constant([1.0, 0.5]))
    run(tf.constant([1.0, 0.5]))
    np.testing.assert_allclose(np.asarray(w), [1.0 - 4.0, 1.0 - 2.0])  # two steps of lr * 2 * g


def test_with_gradient_accumulation_the_hook_sees_the_average_once_per_update():
    seen = []

    def record(grads):
        seen.append([np.asarray(g).tolist() for g in grads])
        return _doubled(grads)

    opt = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=2)
    opt.__class__ = internals.distributed_optimizer_class(opt, record)
    w = keras.Variable(np.array([0.0], "float32"))
    opt.build([w])
    opt.apply([np.array([1.0], "float32")], [w])  # accumulates only: no update, no hook
    assert seen == [] and np.asarray(w).tolist() == [0.0]
    opt.apply([np.array([3.0], "float32")], [w])
    assert seen == [[[2.0]]]  # the average of the two batches
    np.testing.assert_allclose(np.asarray(w), [-4.0])


def test_the_hook_on_a_wrapping_optimizer_sees_the_gradients_before_its_checks():
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), initial_scale=4.0)
    opt.__class__ = internals.distributed_optimizer_class(opt, _doubled)
    w = keras.Variable(np.array([1.0], "float32"))
    opt.build([w])
    scale = float(np.asarray(opt.scale_loss(1.0)))
    opt.apply([np.array([scale], "float32")], [w])  # a scaled gradient of 1
    np.testing.assert_allclose(np.asarray(w), [-1.0])


def test_an_update_that_bypasses_the_hook_raises_instead_of_training_unaveraged():
    class Bypassing(keras.optimizers.SGD):  # what a Keras that stops calling _clip_gradients would do
        def apply(self, grads, trainable_variables=None):
            for g, v in zip(grads, trainable_variables):
                v.assign_sub(g)
            self.iterations.assign_add(1)

    opt = Bypassing(learning_rate=1.0)
    opt.__class__ = internals.distributed_optimizer_class(opt, _doubled)
    w = keras.Variable(np.array([1.0], "float32"))
    with pytest.raises(InternalsChangedError, match="_clip_gradients.*gradients were not averaged"):
        opt.apply([np.array([1.0], "float32")], [w])


def test_an_optimizer_without_the_hook_method_is_refused(monkeypatch):
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    monkeypatch.delattr(BaseOptimizer, "_clip_gradients")
    with pytest.raises(InternalsChangedError, match=r"SGD._clip_gradients .*gradients cannot be averaged"):
        internals.distributed_optimizer_class(keras.optimizers.SGD(), _doubled)


# -- Keras: layers, BatchNormalization, TensorBoard, the global seed generator --------------------


def test_the_compiled_losses_are_where_the_global_batch_wrapper_looks():
    """rank/losses.py wraps CompileLoss._flat_losses when Keras builds them: after a first call they are
    GlobalBatchLoss objects, and the loss Keras computes is unchanged on one rank (no Horovod needed)."""
    from hvd_spark._internal.rank.losses import GlobalBatchLoss, global_batch_losses

    x = keras.Input((3,))
    model = keras.Model(x, keras.layers.Dense(1)(x))
    with pytest.raises(ValueError, match="after model.compile"):
        global_batch_losses(model)
    model.compile("sgd", "mse")
    compile_loss = internals.compile_loss(model)
    assert callable(compile_loss.build) and hasattr(compile_loss, "_flat_losses")
    data = np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")
    want = model.evaluate(*data, verbose=0)
    global_batch_losses(model)
    assert model.evaluate(*data, verbose=0) == pytest.approx(want)
    assert all(isinstance(fn, GlobalBatchLoss) for _, fn, *_ in compile_loss._flat_losses)


def test_a_model_without_the_compiled_loss_attribute_is_refused():
    class Odd:
        compiled = True

    with pytest.raises(InternalsChangedError, match="_compile_loss"):
        internals.compile_loss(Odd())


def test_flatten_layers_finds_layers_inside_nested_models_and_custom_layers():
    class Holder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(2, name="held")

        def call(self, x):
            return self.inner(x)

    inner = keras.Sequential([keras.layers.Dense(3, name="nested")], name="inner")
    model = keras.Sequential([keras.Input((4,)), inner, Holder()])
    names = [layer.name for layer in internals.flatten_layers(model)]
    assert {"inner", "nested", "held"} <= set(names) and model.name not in names


def test_batch_norm_takes_its_training_statistics_from_the_replaced_moments():
    assert _params(keras.layers.BatchNormalization._moments) == ["self", "inputs", "mask"]
    layer = keras.layers.BatchNormalization(center=False, scale=False, epsilon=0.0)
    layer.build((None, 3, 2))
    assert internals.batch_norm_reduction_axes(layer) == [0, 1]
    calls = []

    def moments(bn, inputs, mask):
        calls.append(bn)
        return np.full((2,), 2.0, "float32"), np.full((2,), 9.0, "float32")

    internals.replace_batch_norm_moments(layer, moments)
    x = np.full((1, 3, 2), 5.0, "float32")
    np.testing.assert_allclose(np.asarray(layer(x, training=True)), np.ones((1, 3, 2)), atol=1e-5)  # (5-2)/3
    assert calls == [layer]
    moving = (x - np.asarray(layer.moving_mean)) / np.sqrt(np.asarray(layer.moving_variance))
    np.testing.assert_allclose(np.asarray(layer(x, training=False)), moving, rtol=1e-5)  # no hook at inference
    assert calls == [layer]


def test_batch_norm_without_its_moments_method_is_refused(monkeypatch):
    monkeypatch.delattr(keras.layers.BatchNormalization, "_moments")
    with pytest.raises(InternalsChangedError, match="BatchNormalization._moments.*synchronized=True"):
        internals.replace_batch_norm_moments(keras.layers.BatchNormalization(), lambda *a: None)


def test_tensorboard_epoch_metrics_are_on_disk_when_on_epoch_end_returns(tmp_path):
    """rank.train copies the log folder after each epoch without flushing Keras' writers: Keras writes
    epoch metrics inside ``writer.as_default()``, which TF flushes on exit."""
    cb = keras.callbacks.TensorBoard(log_dir=str(tmp_path), write_graph=False, profile_batch=0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    cb.set_model(model)
    cb.on_train_begin()
    cb.on_epoch_end(0, {"loss": 1.0, "val_loss": 2.0})
    written = {p.parent.name: p.read_bytes() for p in tmp_path.rglob("*.v2")}
    assert b"epoch_loss" in written["train"] and b"epoch_loss" in written["validation"]
    cb.on_train_end()


def test_the_global_seed_generator_state_is_what_unseeded_keras_random_draws_from():
    keras.utils.set_random_seed(1)
    keras.random.uniform((1,))  # creates the global generator
    state = internals.global_seed_generator_state()
    assert state is not None
    state.assign(np.array([7, 7], dtype=keras.backend.standardize_dtype(state.dtype)))
    first = np.asarray(keras.random.uniform((4,)))
    state.assign(np.array([7, 7], dtype=keras.backend.standardize_dtype(state.dtype)))
    np.testing.assert_array_equal(np.asarray(keras.random.uniform((4,))), first)
    state.assign(np.array([8, 7], dtype=keras.backend.standardize_dtype(state.dtype)))
    assert not np.array_equal(np.asarray(keras.random.uniform((4,))), first)


# -- Horovod: the Gloo rendezvous, init, and the hooks' effect over two ranks ----------------------

_RANK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from hvd_spark._internal.common.internals import horovod_initialized
    import horovod.tensorflow as hvd
    import keras
    from hvd_spark._internal.rank.optimizer import make_distributed
    from hvd_spark._internal.rank.batchnorm import synchronize_batch_norm

    before = horovod_initialized()
    hvd.init()
    rank = hvd.rank()
    out = {"before": before, "after": horovod_initialized(), "size": hvd.size()}

    opt = make_distributed(keras.optimizers.SGD(learning_rate=1.0))
    w = keras.Variable(np.zeros(2, "float32"))
    opt.build([w])
    opt.apply([np.array([rank + 1.0, 10.0 * (rank + 1)], "float32")], [w])
    out["weights"] = np.asarray(w).tolist()

    model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(synchronized=True, epsilon=0.0,
                                                                                 center=False, scale=False)])
    out["synced"] = synchronize_batch_norm(model)
    x = np.array([[0.0], [2.0]] if rank == 0 else [[4.0], [6.0]], "float32")
    out["normalized"] = np.asarray(model(x, training=True)).ravel().tolist()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def test_two_ranks_average_gradients_and_batch_norm_statistics_over_the_rendezvous(tmp_path):
    import threading

    from hvd_spark._internal.common.topology import assign_ranks, horovod_env

    ranks = assign_ranks(["127.0.0.1", "127.0.0.1"])
    server = internals.rendezvous_server("127.0.0.1")
    slots = internals.rendezvous_slots(ranks)
    assert [(s.hostname, s.rank, s.size, s.local_size) for s in slots] == [("127.0.0.1", r, 2, 2) for r in (0, 1)]
    internals.declare_rendezvous_scopes(server, slots)
    assert server.scope_size == {"global": 2, "local_127.0.0.1": 2, "cross_0": 1, "cross_1": 1}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    try:
        procs = []
        for info in ranks:
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
            env.update(
                horovod_env(info, rendezvous_addr="127.0.0.1", rendezvous_port=server.server_address[1], iface="lo")
            )
            procs.append(
                subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            )
        results = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err.decode()[-3000:]
            line = next(x for x in out.decode().splitlines() if x.startswith("RESULT "))
            results.append(json.loads(line[len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.shutdown()
        server.server_close()
    for r in results:
        assert (r["before"], r["after"], r["size"], r["synced"]) == (False, True, 2, 1)
        np.testing.assert_allclose(r["weights"], [-1.5, -15.0])  # SGD(1.0) on the average gradient
    # global batch [0, 2, 4, 6]: mean 3, variance 5; each rank normalizes its own rows by them
    np.testing.assert_allclose(
        results[0]["normalized"] + results[1]["normalized"], (np.arange(4) * 2 - 3) / 5**0.5, rtol=1e-5
    )


def test_horovod_rendezvous_internals_have_the_expected_signatures():
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHTTPServer

    assert _params(RendezvousHTTPServer.__init__) == ["self", "addr", "handler", "verbose"]
    assert _params(RendezvousHTTPServer._extract_scope_size) == ["self", "host_alloc_plan"]
    assert list(SlotInfo.__dataclass_fields__) == [
        "hostname",
        "rank",
        "local_rank",
        "cross_rank",
        "size",
        "local_size",
        "cross_size",
    ]


# -- pyspark -------------------------------------------------------------------------------------


def test_pyspark_ml_protected_api_used_by_params_subclasses_exists():
    from pyspark import keyword_only
    from pyspark.ml.param import Param, Params
    from pyspark.ml.util import MLWriter

    assert isinstance(Params._dummy(), Params)
    for name in ("_set", "_setDefault", "_resetUid"):
        assert callable(getattr(Params, name)), name
    assert _params(MLWriter._handleOverwrite) == ["self", "path"]

    class P(Params):
        x = Param(Params._dummy(), "x", "a param")

        @keyword_only
        def __init__(self, x=None):
            super().__init__()
            self._set(**self._input_kwargs)

    assert {p.name: v for p, v in P(x=3)._paramMap.items()} == {"x": 3}


def test_connect_dataframe_has_its_explain_string():
    connect = pytest.importorskip("pyspark.sql.connect.dataframe")
    assert _params(connect.DataFrame._explain_string)[:1] == ["self"]


def test_spark_hooks_count_slots_and_explain_without_printing(spark, capsys):
    executors, slots = internals.spark_executor_slots(spark.sparkContext)
    assert executors >= 0 and slots == spark.sparkContext.defaultParallelism
    text = internals.explain_string(spark.range(3).filter("id > 1"), connect=False)
    assert "== Physical Plan ==" in text and "== Analyzed Logical Plan ==" in text
    assert "Physical Plan" not in capsys.readouterr().out


def test_names_that_earlier_versions_saved_still_load():
    """Spark ML's metadata of a save from the flat module layout names its class by the old module,
    and a saved estimator's callbacks were pickled by the old module of hvd_spark.keras."""
    import pickle

    from pyspark.ml.util import DefaultParamsReader

    import hvd_spark
    import hvd_spark.keras as hk
    from hvd_spark._internal.ml import estimator

    get_class = DefaultParamsReader._DefaultParamsReader__get_class  # what load() and Pipeline.load use
    assert get_class("hvd_spark._internal.transformer.TFTransformer") is hvd_spark.TFTransformer
    assert get_class("hvd_spark._internal.estimator.HorovodEstimator") is hvd_spark.HorovodEstimator
    assert get_class("hvd_spark.TFTransformer") is hvd_spark.TFTransformer  # what saves record now
    assert estimator.__spec__.name == "hvd_spark._internal.ml.estimator"  # the alias left it alone
    # A pickle by reference to the old module of a callback class loads as today's class.
    cls = hk.MetricAverageCallback
    try:
        cls.__module__ = "hvd_spark._internal.keras_hvd"  # as earlier versions pickled it
        payload = pickle.dumps(cls)
    finally:
        cls.__module__ = "hvd_spark._internal.rank.callbacks"
    assert b"hvd_spark._internal.keras_hvd" in payload
    assert pickle.loads(payload) is cls
