"""The Spark ML front on the driver: ``HorovodEstimator`` and ``TFTransformer``, their params, model
introspection, fit planning and MLWritable / MLReadable."""
