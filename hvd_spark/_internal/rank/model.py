"""A rank's model: built from the latest checkpoint or the user's model and compiled as the user
compiled it, its weights' digest, and the seed of its data order."""

import hashlib
import logging

import keras

from hvd_spark._internal.common.contracts import RunConfig

logger = logging.getLogger(__name__)


def weights_digest(model) -> str:
    import numpy as np

    h = hashlib.sha256()
    for v in model.weights:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()


def rank_seed(seed: int, rank: int) -> int:
    """The data-order seed of ``rank``: distinct for every (seed, rank) pair."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank), 0xDA7A]).generate_state(1)[0])


def build_model(cfg: RunConfig, custom_objects):
    """The model to train: the latest checkpoint when resuming, else the user's model, compiled as the
    user compiled it (every ``compile`` option: ``weighted_metrics``, ``steps_per_execution``,
    ``jit_compile``, ``run_eagerly``, ``auto_scale_loss``, the dtype policy) with the optimizer, loss,
    metrics and loss weights given as Params in place of the model's."""
    from hvd_spark._internal.common.serde import load_model_file, loads_keras_obj, model_from_bytes
    from hvd_spark._internal.data.store import Store

    comp = cfg.training.compile
    policy = comp.get("dtype_policy")
    if policy and (policy != "mixed_float16" or comp.get("auto_scale_loss", True)):
        # A Functional model takes the global policy as its own when it is loaded: under the driver's
        # "mixed_float16", compile wraps the optimizer in a LossScaleOptimizer, as it did there.
        keras.mixed_precision.set_global_policy(policy)
    if cfg.start.resume_ckpt:
        store = Store.from_config(cfg.store)
        # Weights, optimizer state (its step counter included) and compile config, as saved.
        resume_ckpt = cfg.start.resume_ckpt
        model = store.files.retrying(
            f"loading the checkpoint {store.files.rel(resume_ckpt)}",
            lambda: load_model_file(
                store.files.url(resume_ckpt), custom_objects, compile=True, storage_options=store.storage_options
            ),
        )
    elif cfg.start.model_bytes is None:
        raise ValueError("The run configuration has neither a checkpoint to resume nor the model to start from.")
    else:
        model = model_from_bytes(cfg.start.model_bytes, custom_objects=custom_objects, compile=True)
        given = {k: comp.get(k) for k in ("optimizer", "loss", "metrics", "loss_weights") if comp.get(k) is not None}
        if given or not getattr(model, "compiled", False):
            kwargs = _compile_config(model, custom_objects)
            kwargs.update({k: loads_keras_obj(v, custom_objects) for k, v in given.items() if k != "loss_weights"})
            if "loss_weights" in given:
                kwargs["loss_weights"] = given["loss_weights"]
            if isinstance(kwargs.get("optimizer"), str):
                kwargs["optimizer"] = keras.optimizers.get(kwargs["optimizer"])
            model.compile(**kwargs, auto_scale_loss=comp.get("auto_scale_loss", True))
    _no_jit_across_ranks(model)
    return model


def checkpoint_weights(cfg: RunConfig, custom_objects, epoch: int) -> list | None:
    """The weights of the run's checkpoint after ``epoch`` epochs (EarlyStopping's best weights after a
    restart or resize: rank/carried.py); None, with a warning, when it is gone."""
    from hvd_spark._internal.common.serde import load_model_file
    from hvd_spark._internal.data.store import Store, checkpoint_names

    store = Store.from_config(cfg.store)
    path = f"{store.checkpoints_path(cfg.run_id)}/{checkpoint_names(epoch)[0]}"
    if not store.files.exists(path):
        logger.warning(
            "the checkpoint of epoch %d is gone: EarlyStopping(restore_best_weights=True) restores the best "
            "weights of the epochs from here on only",
            epoch,
        )
        return None
    model = store.files.retrying(
        f"loading the checkpoint {store.files.rel(path)}",
        lambda: load_model_file(
            store.files.url(path), custom_objects, compile=False, storage_options=store.storage_options
        ),
    )
    return model.get_weights()


def _compile_config(model, custom_objects) -> dict:
    """``compile``'s arguments as the model was compiled (all of them but ``auto_scale_loss``, which
    Keras does not keep), with the loaded optimizer itself (its state) in place of its config."""
    if not getattr(model, "compiled", False):
        return {}
    config = model.get_compile_config() or {}
    with keras.saving.custom_object_scope(custom_objects or {}):
        kwargs = dict(keras.saving.deserialize_keras_object(config)) if config else {}
    if getattr(model, "optimizer", None) is not None:
        kwargs["optimizer"] = model.optimizer
    return kwargs


def _no_jit_across_ranks(model) -> None:
    """XLA cannot compile Horovod's collectives into the train step: with several ranks the step runs
    as a plain ``tf.function`` (a user's ``jit_compile=True`` is turned off, with a warning)."""
    import horovod.tensorflow as hvd

    if hvd.size() > 1 and getattr(model, "jit_compile", False):
        if hvd.rank() == 0:
            logger.warning(
                "jit_compile=True is turned off on the ranks: XLA cannot compile Horovod's gradient allreduce "
                "into the train step (the step runs as a tf.function without XLA). Layers can still use XLA "
                "themselves."
            )
        model.jit_compile = False
