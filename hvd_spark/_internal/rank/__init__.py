"""Inside one rank's own process: the process entry (:mod:`.entry`), what a rank runs during
``fit`` (:mod:`.train`), the Parquet reader and the Keras 3 + Horovod pieces. Never imports pyspark."""
