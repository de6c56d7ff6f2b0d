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

    Each training step sums (count, sum) over the ranks, then the squared deviations from the global
    mean (two passes, as ``tf.nn.moments`` in one process): two allreduces per layer, whose gradients
    are allreduces too, as in Horovod's and PyTorch's SyncBatchNorm.
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
    count, total = tf.unstack(
        hvd.allreduce(tf.stack([tf.reduce_sum(weights, axes), tf.reduce_sum(x * weights, axes)]), op=hvd.Sum)
    )
    mean = tf.math.divide_no_nan(total, count)
    # Two passes, as tf.nn.moments in one process: E[(x - mean)^2], not E[x^2] - mean^2, whose
    # cancellation put the moving variance 1e-4 apart from one process's at the global batch.
    centered = tf.square(x - tf.stop_gradient(tf.reshape(mean, _kept_shape(x, axes)))) * weights
    variance = tf.math.divide_no_nan(hvd.allreduce(tf.reduce_sum(centered, axes), op=hvd.Sum), count)
    return tf.cast(mean, dtype), tf.cast(variance, dtype)


def _kept_shape(x, axes) -> list:
    """``x``'s shape with the reduced ``axes`` as 1 (to broadcast the mean back over them)."""
    shape = tf.unstack(tf.shape(x))
    return [1 if i in {a % len(shape) for a in axes} else d for i, d in enumerate(shape)]
