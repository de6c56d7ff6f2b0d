"""Fitting into Spark ML: horovod.spark's setter and getter names (setBatchSize, getStore, ...)
generated from the Params, and a classifier's Spark ML columns (prediction, probability,
rawPrediction) with how a classifier is recognized."""

import numpy as np
import pytest

import hvd_spark
from hvd_spark._internal.ml.params import camel

# What horovod.spark.keras.KerasEstimator users call (its docs and examples).
HOROVOD_NAMES = [
    "NumProc", "Model", "Backend", "Store", "Optimizer", "Loss", "LossWeights", "Metrics", "FeatureCols",
    "LabelCols", "OutputCols", "SampleWeightCol", "Validation", "Callbacks", "BatchSize", "ValBatchSize",
    "Epochs", "TrainStepsPerEpoch", "ValidationStepsPerEpoch", "Shuffle",
    "CustomObjects", "Verbose", "RandomSeed", "RunId",
]  # fmt: skip


def test_every_estimator_param_has_a_setter_and_a_getter():
    est = hvd_spark.HorovodEstimator()
    for param in est.params:
        assert callable(getattr(est, f"set{camel(param.name)}")), param.name
        assert callable(getattr(est, f"get{camel(param.name)}")), param.name
    for name in HOROVOD_NAMES:
        assert hasattr(est, f"set{name}") and hasattr(est, f"get{name}"), name


def test_setters_chain_convert_and_name_the_param_on_bad_values(tmp_path):
    est = hvd_spark.HorovodEstimator().setBatchSize(16).setEpochs(3).setFeatureCols("x").setStore(str(tmp_path))
    assert (est.getBatchSize(), est.getEpochs(), est.getFeatureCols()) == (16, 3, ["x"])
    assert est.getStore() == str(tmp_path)
    assert est.getOrDefault("batch_size") == 16  # the same Param the constructor sets
    with pytest.raises(TypeError, match="feature_cols must be a column name, a list of column names or a dict"):
        est.setFeatureCols(3)
    with pytest.raises(TypeError, match="num_proc must be an integer or None"):
        est.setNumProc("2")
    # Hand-written getters keep their behaviour (the default output names follow the labels).
    assert est.setLabelCols(["y"]).getOutputCols() == ["y__output"]


def test_transformer_setters_are_the_ones_users_may_change():
    model = hvd_spark.TFTransformer(model_url="file:///m.keras", feature_cols=["x"], label_cols=["y"])
    assert model.setOutputCols(["pred"]).getOutputCols() == ["pred"]
    assert model.setBatchSize(128).getBatchSize() == 128
    assert model.getModelUrl() == "file:///m.keras"
    # A fitted model's record is read-only: no setter for where the model lives or its specs.
    assert not hasattr(model, "setModelUrl") and not hasattr(model, "setInputSpecs")


def _spec(*shape):
    from hvd_spark._internal.common.specs import TensorSpec

    return TensorSpec("out", tuple(shape), "float32")


def test_a_classifier_is_recognized_by_its_loss_and_output_width():
    import keras

    from hvd_spark._internal.ml.model_info import prediction_task

    assert prediction_task("auto", "sparse_categorical_crossentropy", [_spec(10)]) == ("multiclass", False)
    assert prediction_task("auto", keras.losses.SparseCategoricalCrossentropy(from_logits=True), [_spec(3)]) == (
        "multiclass",
        True,
    )
    assert prediction_task("auto", keras.losses.categorical_crossentropy, [_spec(4)]) == ("multiclass", False)
    assert prediction_task("auto", keras.losses.BinaryCrossentropy(from_logits=True), [_spec(1)]) == ("binary", True)
    assert prediction_task("auto", "binary_crossentropy", [_spec()]) == ("binary", False)
    # Multi-label (one sigmoid per label), regression losses, several outputs: no class per row.
    assert prediction_task("auto", "binary_crossentropy", [_spec(5)]) == ("regression", False)
    assert prediction_task("auto", "mse", [_spec(1)]) == ("regression", False)
    assert prediction_task("auto", "sparse_categorical_crossentropy", [_spec(3), _spec(3)])[0] == "regression"
    assert prediction_task("regression", "sparse_categorical_crossentropy", [_spec(3)]) == ("regression", False)
    # Said explicitly: any loss, from the width; an output that cannot be a class is refused.
    assert prediction_task("classification", "my_loss", [_spec(7)]) == ("multiclass", False)
    with pytest.raises(ValueError, match="task='classification' needs a model with one output"):
        prediction_task("classification", "mse", [_spec(2), _spec(1)])
    with pytest.raises(ValueError, match="task must be one of"):
        prediction_task("classify", "mse", [_spec(1)])


def _classifier(task, logits, **cols):
    return hvd_spark.TFTransformer(
        model_url="file:///unused.keras", feature_cols=["x"], output_cols=["o"], task=task, from_logits=logits, **cols
    )


def test_multiclass_columns_from_logits_match_numpy(spark):
    logits = np.array([[2.0, 0.5, -1.0], [0.0, 3.0, 1.0], [-1.0, -2.0, 0.5]])
    df = spark.createDataFrame([(row.tolist(),) for row in logits], "o array<double>")
    out = _classifier("multiclass", True)._with_classifier_cols(df, "o").toPandas()
    assert list(out.columns) == ["o", "prediction", "probability", "rawPrediction"]
    assert out["prediction"].tolist() == [0.0, 1.0, 2.0]
    probs = np.stack([v.toArray() for v in out["probability"]])
    expected = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probs, expected / expected.sum(1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(np.stack([v.toArray() for v in out["rawPrediction"]]), logits)


def test_binary_columns_and_evaluators(spark):
    from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator

    rows = [(0.9, 1.0), (0.2, 0.0), (0.6, 0.0), (0.4, 1.0), (0.7, 1.0)]
    df = spark.createDataFrame(rows, "o double, label double")
    out = _classifier("binary", False)._with_classifier_cols(df, "o")
    pdf = out.toPandas()
    assert pdf["prediction"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    np.testing.assert_allclose(pdf["probability"].iloc[0].toArray(), [0.1, 0.9])
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) == pytest.approx(3 / 5)
    # AUC from rawPrediction: 5 of the 6 (positive, negative) pairs are ordered right.
    assert BinaryClassificationEvaluator().evaluate(out) == pytest.approx(5 / 6)


def test_classifier_column_names_are_params_and_may_be_left_out(spark):
    df = spark.createDataFrame([([1.0, 0.0],)], "o array<double>")
    model = _classifier("multiclass", False, predictionCol="cls", probabilityCol="")
    assert model._with_classifier_cols(df, "o").columns == ["o", "cls", "rawPrediction"]
    assert _classifier("regression", False)._with_classifier_cols(df, "o").columns == ["o"]


def test_a_classifier_column_that_exists_is_refused_before_any_job(spark):
    df = spark.createDataFrame([([1.0], 2.0)], "x array<double>, prediction double")
    with pytest.raises(ValueError, match=r"predictionCol 'prediction' already exists .*\(setPredictionCol\)"):
        _classifier("multiclass", False)._check_columns(df)


def _tuning_setup(spark, tmp_path, *, seed: int, epochs: int):
    """Digits frames, a 2-rank estimator and a grid over learning_rate: 1e-5 barely moves, 0.01 learns."""
    import os
    import sys

    import keras
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import ParamGridBuilder

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from digits import digits_frames, digits_model

    train, test = digits_frames(spark)
    keras.utils.set_random_seed(seed)
    est = hvd_spark.HorovodEstimator(
        num_proc=2, store=str(tmp_path / "store"), model=digits_model(), optimizer=keras.optimizers.Adam(),
        loss="sparse_categorical_crossentropy", feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=epochs, verbose=0,
    )  # fmt: skip
    grid = ParamGridBuilder().addGrid(est.learning_rate, [1e-5, 0.01]).build()
    return train.cache(), test, est, grid, MulticlassClassificationEvaluator(metricName="accuracy")


def test_train_validation_split_over_learning_rate_picks_the_better_model_and_saves(spark, tmp_path):
    """Spark's tuning over a learning_rate grid (no optimizer objects in it), read by a real evaluator;
    the tuning model saves and loads."""
    from pyspark.ml.tuning import TrainValidationSplit, TrainValidationSplitModel

    train, test, est, grid, evaluator = _tuning_setup(spark, tmp_path, seed=1, epochs=3)
    tvs = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, trainRatio=0.8, seed=3)
    tuned = tvs.fit(train)
    slow, fast = tuned.validationMetrics
    assert fast >= 0.9 and slow < fast - 0.2, tuned.validationMetrics
    best = tuned.bestModel
    assert evaluator.evaluate(best.transform(test)) >= 0.9

    tuned.save(str(tmp_path / "tvs"))
    loaded = TrainValidationSplitModel.load(str(tmp_path / "tvs"))
    assert loaded.validationMetrics == pytest.approx(tuned.validationMetrics)
    assert [m[est.learning_rate] for m in loaded.getEstimatorParamMaps()] == [1e-5, 0.01]
    before = best.transform(test).select("prediction").toPandas()["prediction"].tolist()
    after = loaded.bestModel.transform(test).select("prediction").toPandas()["prediction"].tolist()
    assert before == after


def test_cross_validator_over_learning_rate_averages_folds_and_saves(spark, tmp_path):
    """CrossValidator: numFolds fits per grid point on disjoint folds, avgMetrics read by a real
    evaluator, the best grid point refitted on all the data; the tuning model saves and loads."""
    from pyspark.ml.tuning import CrossValidator, CrossValidatorModel

    train, test, est, grid, evaluator = _tuning_setup(spark, tmp_path, seed=5, epochs=2)
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=7)
    tuned = cv.fit(train)
    slow, fast = tuned.avgMetrics
    assert fast >= 0.85 and slow < fast - 0.2, tuned.avgMetrics
    assert tuned.bestModel.getFitSummary() is not None  # refitted on all the data with the best point
    assert evaluator.evaluate(tuned.bestModel.transform(test)) >= 0.85
    runs = sorted(p.name for p in (tmp_path / "store" / "runs").iterdir())
    assert len(runs) == 2 * 2 + 1, runs  # each fold of each grid point, then the refit: its own run

    tuned.save(str(tmp_path / "cv"))
    loaded = CrossValidatorModel.load(str(tmp_path / "cv"))
    assert loaded.avgMetrics == pytest.approx(tuned.avgMetrics)
    assert evaluator.evaluate(loaded.bestModel.transform(test)) == pytest.approx(
        evaluator.evaluate(tuned.bestModel.transform(test))
    )


def test_learning_rate_is_checked_before_any_work(spark, tmp_path):
    import keras

    with pytest.raises(ValueError, match="learning_rate must be a positive number or None"):
        hvd_spark.HorovodEstimator(learning_rate=-0.1)
    with pytest.raises(TypeError, match="learning_rate must be a positive number or None"):
        hvd_spark.HorovodEstimator(learning_rate="0.1")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    est = hvd_spark.HorovodEstimator(
        num_proc=1, store=str(tmp_path / "store"), model=model, optimizer=keras.optimizers.SGD(schedule),
        loss="mse", feature_cols=["x"], label_cols=["y"], learning_rate=0.01,
    )  # fmt: skip
    df = spark.createDataFrame([([1.0, 2.0], 1.0)], "x array<double>, y double")
    with pytest.raises(ValueError, match="learning_rate cannot replace .* LearningRateSchedule"):
        est.fit(df)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.parquet"))
