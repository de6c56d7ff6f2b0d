"""examples/torch_digits.py's networks learn digits through the estimators (torch and Lightning): the
held-out accuracy a broken fit (no averaging, wrong labels, a model that did not train) cannot reach."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


@pytest.fixture(autouse=True)
def _examples_by_value():
    """The example's module is importable here, not on the ranks: its classes and functions travel by
    value (as a script's or a notebook's do, defined in __main__)."""
    import cloudpickle
    import torch_digits

    cloudpickle.register_pickle_by_value(torch_digits)
    yield
    cloudpickle.unregister_pickle_by_value(torch_digits)


def _accuracy(fitted, test_df) -> float:
    rows = fitted.transform(test_df).select("label", "prediction").collect()
    return float(np.mean([r["label"] == r["prediction"] for r in rows]))


def _common(tmp_path):
    return dict(
        num_proc=2,
        store=str(tmp_path / "store"),
        feature_cols=["features"],
        label_cols=["label"],
        validation=0.1,
        batch_size=32,
        epochs=8,
        random_seed=1,
        task="classification",
        verbose=0,
    )


def test_the_torch_digits_network_learns(spark, tmp_path):
    from digits import digits_frames
    from torch_digits import digits_net

    from hvd_spark.torch import TorchEstimator

    train_df, test_df = digits_frames(spark)
    torch.manual_seed(1)
    model = digits_net()
    est = TorchEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.002),
        loss=torch.nn.CrossEntropyLoss(),
        **_common(tmp_path),
    )
    fitted = est.fit(train_df)
    accuracy = _accuracy(fitted, test_df)
    print(f"torch digits: held-out accuracy {accuracy:.3f}, history {fitted.getHistory()['val_loss']}")
    assert accuracy >= 0.9


def test_the_lightning_digits_module_learns(spark, tmp_path):
    pytest.importorskip("lightning.pytorch")
    from digits import digits_frames
    from torch_digits import lightning_net

    from hvd_spark.lightning import TorchEstimator

    train_df, test_df = digits_frames(spark)
    torch.manual_seed(1)
    fitted = TorchEstimator(model=lightning_net(), **_common(tmp_path)).fit(train_df)
    accuracy = _accuracy(fitted, test_df)
    print(f"Lightning digits: held-out accuracy {accuracy:.3f}, history {fitted.getHistory()['val_accuracy']}")
    assert accuracy >= 0.9
    assert fitted.getHistory()["val_accuracy"][-1] >= 0.9
