"""Shared by every process: plain records that cross a boundary, pure decisions, settings, and the
wire protocols every process speaks (the driver service's, the warm servers' requests).

Loads no Spark, TensorFlow, Keras or Horovod, so any process can import it cheaply and the fast
tests cover it without a cluster."""
