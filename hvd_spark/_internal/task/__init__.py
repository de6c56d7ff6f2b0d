"""Inside a Spark barrier task (Spark's Python worker, one per rank): rendezvous through the
barrier, start the rank's process (cold, or forked from a warm server), mpirun and its rsh agent
for MPI jobs, watch the rank and report how it ended. Loads no pyspark at import (a task reads
its ``BarrierTaskContext`` when it runs) and no TensorFlow."""
