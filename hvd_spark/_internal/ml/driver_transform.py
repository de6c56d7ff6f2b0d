"""``transform`` of a small DataFrame made on the driver (``spark.createDataFrame(pandas_df)``: a local
relation), predicted by the driver itself.

The UDF path's first call on an application costs Spark's Python UDF workers (their start and
imports, 1.5 s on 2 cores) and the model's load in each of them; for a few hundred rows that is
twenty times the prediction. The driver holds such a frame's rows already: it predicts them with
the same batching code as the Arrow UDF (``infer/batching.py``'s ``predict_arrow_batches``: the same
checks of invalid features, ``handleInvalid``, ``transformation_fn``, batches of ``batch_size``), its
model loaded once per transformer and model file version, and returns a DataFrame of the same rows
with the predictions. Driver side.
"""

import logging
from typing import Any

from hvd_spark._internal.common import settings
from hvd_spark._internal.data.local_copy import made_on_driver

logger = logging.getLogger(__name__)

PREDICTIONS = "__hvd_spark_driver_pred"  # the predictions' column until the outputs are taken from it


def driver_rows(dataset) -> int | None:
    """The rows of ``dataset`` when the driver predicts them: a local relation (a classic session, a
    pyspark with ``DataFrame.toArrow``) of at most ``HVD_SPARK_DRIVER_TRANSFORM_ROWS`` rows; else None."""
    limit = settings.DRIVER_TRANSFORM_ROWS.get(conf=dataset.sparkSession.conf)
    if not limit or not hasattr(dataset, "toArrow") or not made_on_driver(dataset):
        return None
    try:
        rows = int(dataset._jdf.queryExecution().optimizedPlan().data().size())
    except Exception as e:  # noqa: BLE001 - no plan to read: the UDF predicts
        logger.debug("the DataFrame's plan could not be read (%s): the UDF predicts", e)
        return None
    return rows if rows <= limit else None


class DriverPredictor:
    """The model a transformer predicts with on the driver: loaded once per model file version, with the
    driver's thread pools left as they are."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._model: Any = None

    def get(self, key: str, url: str, opts: dict, custom_objects_bytes: bytes | None):
        from hvd_spark._internal.infer.cache import load_model

        if self._key != key:
            self._model = load_model(url, opts, custom_objects_bytes, 0)  # 0: the driver's threads as they are
            self._key = key
        return self._model


def predicted(dataset, packed, output_type, predict_struct) -> Any:
    """``dataset``'s rows with a column ``PREDICTIONS`` of ``output_type``: ``predict_struct(struct)``'s
    values for the rows' feature struct ``packed`` (an Arrow StructArray in, an Arrow array out)."""
    import pyarrow as pa
    from pyspark.sql import types as T

    rows = dataset.collect()
    struct = dataset.select(packed.alias("features")).toArrow().column("features").combine_chunks()
    if len(struct) != len(rows):  # the same local relation evaluated twice: never expected to differ
        raise RuntimeError(f"the DataFrame gave {len(rows)} rows, then {len(struct)}: predicted by the UDF instead")
    values = predict_struct(struct)
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    schema = T.StructType([*dataset.schema.fields, T.StructField(PREDICTIONS, output_type, True)])
    out = [(*row, value) for row, value in zip(rows, values.to_pylist())]
    return dataset.sparkSession.createDataFrame(out, schema, verifySchema=False)
