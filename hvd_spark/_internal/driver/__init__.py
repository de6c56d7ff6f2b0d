"""The driver's role in a job: validate and launch the barrier stage, serve the tasks and ranks
(``common/service.py``), watch them (:mod:`.supervisor`), show progress and track the run.

On a classic session this runs in the Spark driver. On Spark Connect the client has no JVM and
accepts no connection, so :mod:`.coordinator` runs the same service and supervisor inside the
first barrier task and relays to the client. Loads no TensorFlow, Keras or Horovod."""
