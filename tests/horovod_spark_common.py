"""What horovod's ``test/utils/spark_common.py`` and ``test/utils/common.py`` give its
``test_spark_keras.py``, for the port in ``test_horovod_spark_keras.py`` (horovod at 2626dc87,
Apache License 2.0). The data helpers are copied unchanged; the session, store and temporary path
helpers are shims with horovod's names:

* ``spark_session(app, cores=2)``: the test run's shared ``local[2]`` session (tests/conftest.py's
  ``spark`` fixture, set by the port's autouse fixture) instead of a new session per test; Spark is
  slow to start on 2 cores and a process has one SparkContext. ``cores`` above 2 is refused.
* ``local_store()``: an ``hvd_spark.Store`` in a temporary folder (horovod: ``LocalStore``).
* ``temppath()``: a path in a temporary folder that does not exist yet.
"""

import contextlib
import os
import shutil
import tempfile

from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import DenseVector, VectorUDT
from pyspark.sql.types import FloatType, IntegerType, StructField, StructType

from hvd_spark import Store

SESSION = {}  # "spark": the shared session, set by test_horovod_spark_keras.py's autouse fixture


@contextlib.contextmanager
def spark_session(app, cores=2, gpus=0, *args, **kwargs):
    if cores > 2:
        raise ValueError(f"the shared test session is local[2]; {app} asked for {cores} cores")
    yield SESSION["spark"]


@contextlib.contextmanager
def local_store():
    with tempfile.TemporaryDirectory() as tmp:
        yield Store(os.path.join(tmp, "store"))


@contextlib.contextmanager
def temppath():
    dirpath = tempfile.mkdtemp()
    try:
        yield os.path.join(dirpath, "saved")
    finally:
        shutil.rmtree(dirpath, ignore_errors=True)


# --- copied from horovod's test/utils/spark_common.py ---------------------------------------------


def with_features(raw_df, feature_cols):
    vector_assembler = VectorAssembler().setInputCols(feature_cols).setOutputCol("features")
    pipeline = Pipeline().setStages([vector_assembler])

    df = pipeline.fit(raw_df).transform(raw_df)
    return df


def create_xor_data(spark):
    data = [[0, 0, 0.0, 0.1], [0, 1, 1.0, 0.2], [1, 0, 1.0, 0.3], [1, 1, 0.0, 0.4]]
    schema = StructType(
        [
            StructField("x1", IntegerType()),
            StructField("x2", IntegerType()),
            StructField("y", FloatType()),
            StructField("weight", FloatType()),
        ]
    )
    raw_df = create_test_data_from_schema(spark, data, schema)
    df = with_features(raw_df, ["x1", "x2"])
    return df


def create_xor_data_with_val(spark):
    data = [
        [0, 0, 0.0, 0.1, 1],
        [0, 1, 1.0, 0.2, 0],
        [1, 0, 1.0, 0.3, 1],
        [1, 1, 0.0, 0.4, 0],
        [0, 0, 0.0, 0.1, 1],
        [0, 1, 1.0, 0.2, 0],
        [1, 0, 1.0, 0.3, 1],
        [1, 1, 0.0, 0.4, 0],
    ]
    schema = StructType(
        [
            StructField("x1", IntegerType()),
            StructField("x2", IntegerType()),
            StructField("y", FloatType()),
            StructField("weight", FloatType()),
            StructField("val", IntegerType()),
        ]
    )
    raw_df = create_test_data_from_schema(spark, data, schema)
    df = with_features(raw_df, ["x1", "x2"])
    return df


def create_mnist_data(spark):
    features = DenseVector([1.0] * 64)
    label_vec = DenseVector([0.0, 0.0, 1.0] + [0.0] * 7)
    label = 2.0
    data = [[features, label_vec, label]] * 10
    schema = StructType(
        [StructField("features", VectorUDT()), StructField("label_vec", VectorUDT()), StructField("label", FloatType())]
    )
    df = create_test_data_from_schema(spark, data, schema)
    return df


def create_test_data_from_schema(spark, data, schema):
    return spark.createDataFrame(data, schema=schema)
