"""hvd_spark.lightning.TorchEstimator against plain torch: a LightningModule trained by Lightning's Trainer
on real ranks (Spark ``local[2]``, DDP over Gloo in the processes hvd_spark starts), on the table read in
place with ``shuffle=False`` (rank r reads the r-th half of the training rows), equals a plain torch loop
at the global batch on the rows interleaved as the ranks read them: weights and the logged epoch values.
"""

import os
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
nn = torch.nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])

sys.path.insert(0, os.path.dirname(__file__))
from _torch_helpers import FEATURES, ROWS, B, assert_matches, interleaved, plain_fit  # noqa: E402
from _torch_helpers import data as _data  # noqa: E402
from _torch_helpers import write as _write  # noqa: E402

CLASSES = 3


class LitNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self(batch["features"]), batch["label"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss_fn(self(batch["features"]), batch["label"])
        self.log("val_loss", loss, on_epoch=True, sync_dist=True, batch_size=len(batch["label"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _plain(x, y, epochs):
    torch.manual_seed(0)
    model = LitNet()
    order, val = interleaved(ROWS, 2), (x[ROWS:], y[ROWS:])
    history = plain_fit(model, model.configure_optimizers(), model.loss_fn, x, y, order, 2 * B, epochs, val)
    return model, {"train_loss": history["loss"], "val_loss": history["val_loss"]}


def _fit(spark, tmp_path, path, epochs, **params):
    from hvd_spark.lightning import TorchEstimator

    torch.manual_seed(0)
    est = TorchEstimator(
        num_proc=2,
        store=str(tmp_path / "store"),
        model=LitNet(),
        feature_cols=["features"],
        label_cols=["label"],
        validation="is_val",
        batch_size=B,
        val_batch_size=B,
        epochs=epochs,
        shuffle=False,
        materialize="never",
        verbose=0,
        **params,
    )
    fitted = est.fit(spark.read.parquet(path))
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1, fitted.getFitSummary().ranks
    return fitted


def _assert_equal(fitted, plain, want):
    assert_matches(fitted, plain, want, all_keys=False)


def test_two_ranks_of_a_lightning_module_equal_plain_torch_at_the_global_batch(spark, tmp_path):
    x, y = _data()
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, epochs=2)
    fitted = _fit(spark, tmp_path, path, epochs=2)
    _assert_equal(fitted, plain, want)
    assert [r.iterations for r in fitted.getFitSummary().ranks] == [2 * ROWS // (2 * B)] * 2


def test_a_resumed_lightning_run_equals_one_fit_and_transform(spark, tmp_path):
    """1 epoch, then the same run_id to 3: Lightning's own checkpoint (optimizer, loops) comes back from
    the store's; the result equals 3 epochs at once. The model predicts in transform as the module does."""
    x, y = _data(1)
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, epochs=3)
    _fit(spark, tmp_path, path, epochs=1, run_id="lit")
    fitted = _fit(spark, tmp_path, path, epochs=3, run_id="lit")
    _assert_equal(fitted, plain, want)
    df = spark.read.parquet(path).where("is_val")
    rows = fitted.transform(df).collect()
    with torch.no_grad():
        want_out = plain(torch.as_tensor(np.stack([r["features"] for r in rows]).astype("float32"))).numpy()
    np.testing.assert_allclose(np.stack([r["label__output"] for r in rows]), want_out, rtol=1e-5, atol=1e-5)


def test_a_lightning_module_refuses_an_optimizer_param(spark, tmp_path):
    from hvd_spark.lightning import TorchEstimator

    x, y = _data(2)
    path = _write(tmp_path, x, y)
    model = LitNet()
    est = TorchEstimator(
        num_proc=1,
        store=str(tmp_path / "store"),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        feature_cols=["features"],
        label_cols=["label"],
    )
    with pytest.raises(ValueError, match="configure_optimizers"):
        est.fit(spark.read.parquet(path))
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.pt"))


def test_lightning_params_refused_and_saved(spark, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from hvd_spark.lightning import TorchEstimator

    x, y = _data(3)
    path = _write(tmp_path, x, y)
    common = dict(num_proc=2, store=str(tmp_path / "store"), feature_cols=["features"], label_cols=["label"])
    with pytest.raises(ValueError, match="learning_rate"):
        TorchEstimator(model=LitNet(), learning_rate=0.5, **common).fit(spark.read.parquet(path))
    one_val_row = spark.read.parquet(path).where(f"not is_val or features[0] = {float(x[ROWS, 0])}")
    with pytest.raises(Exception, match="no validation rows"):
        TorchEstimator(model=LitNet(), validation="is_val", **common).fit(one_val_row)
    est = TorchEstimator(model=LitNet(), logger=CSVLogger(str(tmp_path / "logs")), epochs=2, **common)
    est.write().save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert isinstance(loaded.getOrDefault("logger"), CSVLogger) and loaded.getOrDefault("epochs") == 2
