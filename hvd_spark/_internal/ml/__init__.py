"""The Spark ML front on the driver: ``HorovodEstimator``, its params, model introspection,
fit planning and MLWritable / MLReadable."""
