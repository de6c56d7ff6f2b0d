"""``transform`` of a small DataFrame made on the driver (``spark.createDataFrame(pandas_df)``: a local
relation) or held in a filled cache, predicted by the driver itself.

The UDF path's first call on an application costs Spark's Python UDF workers (their start and
imports, 1.5 s on 2 cores) and the model's load in each of them; for a few hundred rows that is
twenty times the prediction. The driver holds such a frame's rows already, or a small cache holds
them: it collects them as Arrow (one small Spark job, no Python worker), predicts them with the same
batching code as the Arrow UDF (``infer/batching.py``'s ``predict_arrow_batches``: the same checks of
invalid features, ``handleInvalid``, ``transformation_fn``, batches of ``batch_size``), its model
loaded once per transformer and model file version, and returns a local relation of the same rows
with the predictions. Driver side.
"""

import logging
import threading
from typing import Any

from hvd_spark._internal.common import settings

logger = logging.getLogger(__name__)


def driver_rows(dataset) -> int | None:
    """The rows of ``dataset`` when the driver predicts them, else None: a local relation (a classic
    session, a pyspark with ``DataFrame.toArrow``), or a cached DataFrame whose cache is filled (its row
    count and size are then exact: a ``CrossValidator``'s fold after its first evaluation, a ``df.cache()``
    an action filled) of at most ``HVD_SPARK_LOCAL_COPY_BYTES``; either of at most
    ``HVD_SPARK_DRIVER_TRANSFORM_ROWS`` rows."""
    conf = dataset.sparkSession.conf
    limit = settings.DRIVER_TRANSFORM_ROWS.get(conf=conf)
    if not limit or not hasattr(dataset, "toArrow") or not hasattr(dataset, "_jdf"):
        return None
    try:
        plan = dataset._jdf.queryExecution().optimizedPlan()
        kind = plan.getClass().getSimpleName()
        if kind == "LocalRelation":
            rows: int | None = int(plan.data().size())
        elif kind == "InMemoryRelation":
            rows = _cached_rows(plan, settings.LOCAL_COPY_BYTES.get(conf=conf))
        else:
            return None
    except Exception as e:  # noqa: BLE001 - no plan to read (Spark Connect, another JVM API): the UDF predicts
        logger.debug("the DataFrame's plan could not be read (%s): the UDF predicts", e)
        return None
    return rows if rows is not None and rows <= limit else None


def _cached_rows(relation, max_bytes: int) -> int | None:
    """The rows of a filled cache (an ``InMemoryRelation``'s statistics, exact once its buffers are
    built) of at most ``max_bytes``; None when it is not filled yet or larger."""
    if not max_bytes or not relation.cacheBuilder().isCachedColumnBuffersLoaded():
        return None
    stats = relation.computeStats()
    if not stats.rowCount().isDefined() or int(str(stats.sizeInBytes())) > max_bytes:  # BigInts: a py4j int or not
        return None
    return int(str(stats.rowCount().get()))


class DriverPredictor:
    """The model a transformer predicts with on the driver: loaded once per model file version, with the
    driver's thread pools left as they are. Threads may share it (a CrossValidator's ``parallelism``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: tuple[str, Any] | None = None

    def get(self, key: str, url: str, opts: dict, custom_objects_bytes: bytes | None):
        from hvd_spark._internal.infer.cache import load_model

        with self._lock:
            if self._loaded is None or self._loaded[0] != key:
                # 0 threads: the driver's pools as they are
                self._loaded = (key, load_model(url, opts, custom_objects_bytes, 0))
            return self._loaded[1]


def free_name(base: str, taken) -> str:
    """``base``, or ``base`` with a number, that is not among the names ``taken``."""
    taken, name, i = set(taken), base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def predicted(dataset, packed, name: str, output_type, predict_struct) -> Any:
    """``dataset``'s rows with a column ``name`` of ``output_type``: ``predict_struct(struct)``'s values
    for the rows' feature struct ``packed`` (an Arrow StructArray in, an Arrow array out), or None when
    the rows do not convert to Arrow and back (the UDF predicts them then). The rows go through Arrow
    both ways (``toArrow``, ``createDataFrame`` of an Arrow table: a local relation again), never
    through Python objects, so every column comes back as it was (timestamps included)."""
    import pyarrow as pa
    from pyspark.sql import types as T

    features = free_name("__hvd_spark_features", dataset.columns)
    try:
        table = dataset.select("*", packed.alias(features)).toArrow()
    except Exception as e:  # noqa: BLE001 - a column Arrow cannot hold: the UDF path reads it as Spark does
        logger.debug("the DataFrame did not convert to Arrow (%s): the UDF predicts", e)
        return None
    values = predict_struct(table.column(features).combine_chunks())  # its errors are the user's
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    schema = T.StructType([*dataset.schema.fields, T.StructField(name, output_type, True)])
    try:
        return dataset.sparkSession.createDataFrame(table.drop_columns([features]).append_column(name, values), schema)
    except Exception as e:  # noqa: BLE001 - as above
        logger.debug("the predictions did not convert back from Arrow (%s): the UDF predicts", e)
        return None
