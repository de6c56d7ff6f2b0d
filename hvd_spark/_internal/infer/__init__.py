"""Batch prediction in Spark's Python UDF workers (and a warm server's inference child): the
batching, the per-worker model cache, the device. ``TFTransformer``, which builds the UDF on the
driver, is ``ml/transformer.py``'s. Loads no Horovod."""
