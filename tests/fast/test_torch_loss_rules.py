"""Which torch losses need the global denominator's allreduce on the ranks (``ml/torch_framework.py``'s
``_may_ignore``, from the label columns' statistics), as pure decisions: no torch import."""

from types import SimpleNamespace

from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec
from hvd_spark._internal.ml.torch_framework import TorchFramework


def _checked(ignore_index=-100, name="label", transformation_fn=None):
    out = TensorSpec("label", (10,), "float32", class_axis=0, ignore_index=ignore_index)
    return SimpleNamespace(
        outputs=[out],
        l_infos=[ColumnInfo(name, "scalar", "long", True)],
        p=SimpleNamespace(transformation_fn=transformation_fn),
    )


def _stats(name, low, high):
    return {"columns": {name: {"min": low, "max": high}}}


def test_labels_that_cannot_be_ignore_index_need_no_allreduce():
    fw = TorchFramework()
    assert fw._may_ignore(_checked(), _stats("label", 0, 9)) == [False]
    assert fw._may_ignore(_checked(ignore_index=3), _stats("label", 0, 9)) == [True]  # inside the range
    assert fw._may_ignore(_checked(), _stats("label", -100, 9)) == [True]  # padded positions
    assert fw._may_ignore(_checked(), None) == [True]  # unknown: the collective
    assert fw._may_ignore(_checked(transformation_fn=abs), _stats("label", 0, 9)) == [True]
    assert fw._may_ignore(_checked(ignore_index=None), _stats("label", 0, 9)) == [False]  # no class-index loss


def test_a_label_group_is_looked_up_by_its_columns_name():
    group = "[a, b]"  # ColumnInfo.name of a stacked group, the statistics' key
    assert TorchFramework()._may_ignore(_checked(name=group), _stats(group, 0, 1)) == [False]
