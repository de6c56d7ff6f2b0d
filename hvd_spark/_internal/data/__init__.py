"""The store (data, checkpoints, models, leases) and the driver's data path into it: checks,
the dataset's identity, the validation split, materialization. Loads no TensorFlow or Keras."""
