"""Labels as Keras takes them (issue 46, points 4 and 8c), as pure decisions: the values a label may
hold per row, the shape the ranks give it, whether transform adds classifier columns, and the message
of ``fit`` given ``keras.Model.fit``'s arguments."""

import pytest

from hvd_spark._internal.common.specs import (
    TensorSpec,
    check_label_lengths,
    class_index_shape,
    label_shapes,
    label_values,
)
from hvd_spark._internal.ml.fit_params import fit_arguments_error
from hvd_spark._internal.ml.model_info import prediction_task

TAGS = TensorSpec("tags", (12, 3), "float32")  # a per-step output: 12 steps, 3 classes
PIXELS = TensorSpec("mask", (4, 5, 3), "float32")  # a per-pixel output
CLASSES = TensorSpec("cls", (3,), "float32")


def test_class_indices_take_the_output_shape_without_its_class_axis():
    assert class_index_shape(CLASSES) == ()
    assert class_index_shape(TAGS) == (12,)
    assert class_index_shape(PIXELS) == (4, 5)
    assert class_index_shape(TensorSpec("seq", (None, 3), "float32")) is None
    assert label_values(TAGS, class_indices=True) == (12,)
    assert label_values(PIXELS, class_indices=True) == (20,)
    assert label_values(CLASSES, class_indices=True) == (1,)
    assert label_values(TAGS) == (1, 36)  # other losses: a scalar, or one value per output value


def test_torch_class_indices_drop_the_first_axis_and_may_hold_ignore_index():
    """torch's class axis is the first after the batch ((N, C, T) for CrossEntropyLoss); a label equal to the
    loss's ignore_index (a padded position) is valid, other values outside [0, C) are not."""
    from hvd_spark._internal.common.specs import ColumnInfo
    from hvd_spark._internal.data.stats import check_class_indices

    tags = TensorSpec("tags", (3, 12), "float32", class_axis=0, ignore_index=-100)
    assert class_index_shape(tags) == (12,) and label_values(tags, class_indices=True) == (12,)
    assert TensorSpec.from_dict(tags.to_dict()) == tags
    info = ColumnInfo("tags", "array", "long", True)
    check_class_indices(info, tags, {"min": -100, "max": 2})  # padded positions
    for low, high in ((-1, 2), (-100, 3)):
        with pytest.raises(ValueError, match=r"must be in \[0, 2\]"):
            check_class_indices(info, tags, {"min": low, "max": high})


def test_the_ranks_reshape_per_step_class_indices():
    # only outputs of several axes with a sparse loss get a shape of their own; the rest stay the reader's
    assert label_shapes(None, [TAGS, CLASSES], [True, True]) == ((12,), None)
    assert label_shapes(None, [PIXELS], [True]) == ((4, 5),)
    assert label_shapes(None, [TAGS, CLASSES], [False, True]) is None
    assert label_shapes([[12, 1], [1]], [TAGS, CLASSES], [True, True]) == ((12, 1), (1,))  # given: as given


def test_label_lengths_of_sparse_and_dense_losses():
    check_label_lengths("tags", TAGS, 12, 12, "array", class_indices=True)
    check_label_lengths("mask", PIXELS, 20, 20, "array", class_indices=True)
    check_label_lengths("cls", CLASSES, None, None, "scalar", class_indices=True)
    check_label_lengths("tags", TAGS, 36, 36, "array")  # one-hot per step, categorical_crossentropy
    with pytest.raises(ValueError, match=r"label column 'tags' has 11 values per row\. Expected 12 \(one class index "):
        check_label_lengths("tags", TAGS, 11, 11, "array", class_indices=True)
    with pytest.raises(ValueError, match=r"Model output 'tags' has shape \(None, 12, 3\) .*has 36 values per row"):
        check_label_lengths("tags", TAGS, 36, 36, "array", class_indices=True)  # one-hot for a sparse loss
    with pytest.raises(ValueError, match=r"label column 'tags' has 12 values per row\. Expected 1 \(a class index or"):
        check_label_lengths("tags", TAGS, 12, 12, "array")  # per-step ids with a loss that takes one-hot rows
    with pytest.raises(
        ValueError, match=r"'cls' has 3 values per row\. Expected 1 \(a class index: the loss is a sparse"
    ):
        check_label_lengths("cls", CLASSES, 3, 3, "array", class_indices=True)


def test_a_per_step_output_is_no_classifier_for_transform():
    assert prediction_task("auto", "sparse_categorical_crossentropy", [CLASSES]) == ("multiclass", False)
    assert prediction_task("auto", "sparse_categorical_crossentropy", [TAGS]) == ("regression", False)
    assert prediction_task("auto", "binary_crossentropy", [TensorSpec("p", (), "float32")]) == ("binary", False)
    with pytest.raises(ValueError, match=r"task='classification' needs a model with one output of one unit"):
        prediction_task("classification", "sparse_categorical_crossentropy", [TAGS])


def test_keras_fit_arguments_name_the_param_to_set():
    message = str(fit_arguments_error({"initial_epoch": 3}))
    assert "Received: initial_epoch=3" in message
    assert "a fit resumes a run at its next epoch: pass the run's run_id=" in message
    assert "the epochs Param is the total number of epochs of the run" in message
    message = str(fit_arguments_error({"batch_size": 64, "validation_steps": 2, "nope": 1}))
    assert "batch_size: set the estimator's Param batch_size (rows per step per rank)" in message
    assert "validation_steps: set the estimator's Param validation_steps_per_epoch" in message
    assert "nope: not an argument of fit" in message
    assert "Received: x=<_Big>. x: set the estimator's Param feature_cols" in str(fit_arguments_error({"x": _Big()}))


class _Big:
    def __repr__(self):
        return "x" * 100
