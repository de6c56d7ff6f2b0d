"""Losses normalised over the global batch on the ranks.

Keras reduces a loss with ``"sum_over_batch_size"`` by dividing the batch's weighted sum by its
number of values, unless the model's output carries a mask: then by the number of unmasked values
(``keras.src.losses.loss.apply_mask``). ``"mean_with_sample_weight"`` divides by the sum of the
sample weights (times the mask), and ``"sum"`` does not divide. When each of ``N`` ranks divides by
its own batch's content and the gradients are averaged, the ranks' batches weigh alike however many
values each one counted; one process at the global batch divides the whole sum once. So during
training each such loss is rescaled on every rank by ``N * local / total``, where ``local`` is this
rank's denominator and ``total`` the sum of all ranks' (one allreduce of a scalar per loss and step):
the average of the ranks' gradients is then the global batch's gradient, and the average of the
ranks' losses is its loss. ``"sum"`` is multiplied by ``N``. Losses whose denominator cannot differ
between ranks (no mask, no weighted mean) are left as they are, with no collective.

Validation (``test_step``) is left to Keras: each rank's validation batches are reduced as Keras
reduces them in ``evaluate``, and their states are summed over the ranks.

The mask is the one Keras takes from the model's output (``y_pred``), and for a
``SparseCategoricalCrossentropy(ignore_class=k)`` the labels that are not ``k`` (the mask its ``call``
returns); another custom ``Loss.call`` that returns a masked tensor of its own is reduced by Keras with
that mask too, but its denominator here is the output's (or none): such a loss is normalised per rank.
"""

import contextvars

import tensorflow as tf

_TRAINING = contextvars.ContextVar("hvd_spark_global_batch_training", default=False)
_ATTR = "_hvd_spark_global_batch"


class GlobalBatchLoss:
    """One compiled loss (a ``keras.losses.Loss``: Keras wraps functions in ``LossFunctionWrapper``),
    rescaled during training as the module says. Called as Keras calls a compiled loss."""

    def __init__(self, inner, index: int):
        self.inner, self.index = inner, index

    def __getattr__(self, name):  # Keras reads the loss's name, dtype, reduction ...
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = self.inner(y_true, y_pred, sample_weight)
        if not _TRAINING.get():
            return value
        name = f"hvd_spark.loss_denominator.{self.index}"
        return rescale(value, self.inner, y_pred, sample_weight, name, y_true=y_true)


def local_denominator(loss, y_pred, sample_weight, dtype, y_true=None):
    """What ``loss`` divides this batch's sum by, where that depends on the batch's content (a mask, the
    sample weights), else None. ``"sum"``: 1 (the global batch does not divide either). The mask is the
    output's, and that of the labels a sparse cross-entropy's ``ignore_class`` leaves out."""
    from keras.src.backend import get_keras_mask
    from keras.src.losses.loss import apply_mask, standardize_reduction

    reduction = standardize_reduction(getattr(loss, "reduction", "sum_over_batch_size"))
    mask = get_keras_mask(y_pred)
    ignored = getattr(loss, "ignore_class", None)
    if ignored is not None and y_true is not None:
        valid = _not_ignored(y_true, y_pred, ignored)
        mask = valid if mask is None else tf.logical_and(tf.cast(mask, tf.bool), valid)
    if reduction == "sum":
        return tf.constant(1.0, dtype)
    if reduction in ("sum_over_batch_size", "mean") and mask is not None:
        return tf.reduce_sum(tf.cast(mask, dtype))
    if reduction == "mean_with_sample_weight" and (mask is not None or sample_weight is not None):
        weights = apply_mask(
            None if sample_weight is None else tf.convert_to_tensor(sample_weight), mask, dtype, reduction
        )
        return tf.reduce_sum(tf.cast(weights, dtype))
    return None


def _not_ignored(y_true, y_pred, ignored):
    """Keras' ``sparse_categorical_crossentropy(ignore_class=...)`` mask: the labels that are not
    ``ignored``, in the shape of the output without its class axis."""
    yt = tf.convert_to_tensor(y_true)
    if len(yt.shape) == len(y_pred.shape) and yt.shape[-1] == 1:
        yt = tf.squeeze(yt, axis=-1)
    valid = tf.not_equal(tf.cast(yt, tf.float32), tf.cast(ignored, tf.float32))
    return tf.reshape(valid, tf.shape(y_pred)[:-1])


def rescale(value, loss, y_pred, sample_weight, name: str, y_true=None):
    """``value`` (this rank's reduced loss) times ``N * local / total`` (``N`` for ``"sum"``); an
    unreduced loss (``reduction=None``: one value per row, whose gradient is that of their sum) keeps its
    values and gets ``N`` times their gradient."""
    import horovod.tensorflow as hvd

    size = hvd.size()
    n = tf.cast(size, value.dtype)
    if size > 1 and getattr(loss, "reduction", "sum_over_batch_size") in (None, "none"):
        return value * n - tf.stop_gradient(value * (n - 1))  # the values as they are, N x their gradient
    local = local_denominator(loss, y_pred, sample_weight, value.dtype, y_true)
    if size == 1 or local is None:
        return value
    if getattr(loss, "reduction", None) == "sum":
        return value * n
    total = hvd.allreduce(tf.stop_gradient(local), op=hvd.Sum, name=name)
    return value * tf.stop_gradient(tf.math.divide_no_nan(n * local, tf.cast(total, value.dtype)))


def global_batch_losses(model) -> None:
    """Makes ``model``'s compiled losses global-batch losses during training (not in ``test_step``).

    The compiled model, its ``compile`` config and what it saves are unchanged: the losses Keras built
    for the model (``CompileLoss``) are wrapped when Keras builds them, and ``train_step`` marks the
    training calls (a user's ``train_step`` that calls ``self.compute_loss`` too).
    """
    from hvd_spark._internal.common import internals

    if getattr(model, _ATTR, False):
        return
    if not getattr(model, "compiled", False):
        raise ValueError("global_batch_losses(model) needs a compiled model: call it after model.compile(...).")
    compile_loss = internals.compile_loss(model)
    if compile_loss is None:  # compiled without a loss (a custom train_step computing its own)
        return
    build = compile_loss.build

    def wrap() -> None:
        flat = getattr(compile_loss, "_flat_losses", None) or []
        compile_loss._flat_losses = [
            (path, fn if fn is None or isinstance(fn, GlobalBatchLoss) else GlobalBatchLoss(fn, i), *rest)
            for i, (path, fn, *rest) in enumerate(flat)
        ]

    def build_then_wrap(y_true, y_pred):
        build(y_true, y_pred)
        wrap()

    if getattr(compile_loss, "built", False):
        wrap()
    else:
        compile_loss.build = build_then_wrap
    train_step = model.train_step

    def marked_train_step(*args, **kwargs):
        token = _TRAINING.set(True)
        try:
            return train_step(*args, **kwargs)
        finally:
            _TRAINING.reset(token)

    object.__setattr__(model, "train_step", marked_train_step)
    object.__setattr__(model, _ATTR, True)
