"""``BatchNormalization(synchronized=True)`` over Horovod ranks: batch statistics of the global batch.

Keras implements ``synchronized=True`` through ``tf.distribute`` replica contexts, which Horovod
does not use; without :func:`synchronize_batch_norm`, such layers silently normalize by the rank's
own batch.
"""

import tensorflow as tf

from hvd_spark._internal.common import internals


def synchronize_batch_norm(model) -> int:
    """Makes every ``BatchNormalization(synchronized=True)`` layer of ``model`` compute its batch
    statistics over the global batch of all Horovod ranks; returns how many layers it changed.

    Each training step sums (count, sum, sum of squares) over the ranks with one allreduce per
    layer, whose gradient is an allreduce too, as in Horovod's and PyTorch's SyncBatchNorm.
    Inference (``training=False``) uses the moving statistics and no collective.

    Raises:
        InternalsChangedError: this Keras computes BatchNormalization's statistics in a way the
            hook cannot replace (see ``internals.replace_batch_norm_moments``).
    """
    import keras

    changed = 0
    for layer in internals.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False):
            internals.replace_batch_norm_moments(layer, global_moments)
            changed += 1
    return changed


def global_moments(layer, inputs, mask):
    """Mean and variance over the reduction axes of all ranks' batches (see synchronize_batch_norm)."""
    import horovod.tensorflow as hvd

    x = tf.convert_to_tensor(inputs)
    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
    axes = internals.batch_norm_reduction_axes(layer)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    local = tf.stack(
        [tf.reduce_sum(weights, axes), tf.reduce_sum(x * weights, axes), tf.reduce_sum(tf.square(x) * weights, axes)]
    )
    count, total, squares = tf.unstack(hvd.allreduce(local, op=hvd.Sum))
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    return tf.cast(mean, dtype), tf.cast(variance, dtype)
