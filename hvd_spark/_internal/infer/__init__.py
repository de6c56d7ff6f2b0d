"""Batch prediction: the transformer's params and persistence on the driver, and the prediction
code that runs in Spark's Python UDF workers. Loads no Horovod."""
