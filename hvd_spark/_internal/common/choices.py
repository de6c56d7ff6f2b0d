"""The values a string param or option may take, defined once: the Params' checkers (on the driver,
without TensorFlow) and the code that acts on each value import them from here."""

BACKENDS = ("gloo", "mpi")  # Horovod's controller of a job
COMPRESSIONS = ("none", "fp16")  # gradient compression of the allreduce
READERS = ("arrow", "petastorm")  # the rank-side reader of the materialized data
REUSE_MODES = ("auto", "always", "never")  # whether a fit reuses materialized data
MATERIALIZE_MODES = ("auto", "always", "never")  # whether a fit copies its data or reads the table in place
TASKS = ("auto", "classification", "regression")  # the estimator's task: how to train
PREDICTION_TASKS = ("multiclass", "binary", "regression")  # the transformer's task: what the output is
INFERENCE_UDFS = ("auto", "arrow", "pandas")  # how transform calls the model
MLFLOW_MODES = ("auto", "on", "off")  # MLflow tracking of a fit
