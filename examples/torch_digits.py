"""digits.py's job with a torch model: scikit-learn's digits (1,797 8x8 images, 10 classes) on local Spark.

    .venv/bin/python examples/torch_digits.py [--num-proc 2] [--epochs 12] [--store ./hvd_spark_store]
    .venv/bin/python examples/torch_digits.py --lightning       # the same network as a LightningModule

Fits a small convolutional network with 2 ranks (DistributedDataParallel over Gloo), evaluates on a
held-out split with transform(), saves and loads the fitted TorchModel and checks that the loaded one
predicts the same. Needs the torch extra (and lightning for --lightning).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from digits import digits_frames, job_arguments, job_session  # noqa: E402  # the same data as the Keras job


def digits_net():
    from torch import nn

    class DigitsNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
            )
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, pixels):
            return self.head(self.conv(pixels.reshape(-1, 1, 8, 8)))

    return DigitsNet()


def lightning_net():
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class LitDigits(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = digits_net()
            self.loss_fn = nn.CrossEntropyLoss()

        def forward(self, pixels):
            return self.net(pixels)

        def training_step(self, batch, batch_idx):
            loss = self.loss_fn(self(batch["features"]), batch["label"])
            self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(batch["label"]))
            return loss

        def validation_step(self, batch, batch_idx):
            logits = self(batch["features"])
            n = len(batch["label"])
            self.log("val_loss", self.loss_fn(logits, batch["label"]), sync_dist=True, batch_size=n)
            accuracy = (logits.argmax(1) == batch["label"]).float().mean()
            self.log("val_accuracy", accuracy, sync_dist=True, batch_size=n)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.002)

    return LitDigits()


def main():
    p = job_arguments(__doc__)
    p.add_argument("--lightning", action="store_true", help="train a LightningModule with Lightning's Trainer")
    a = p.parse_args()
    import tempfile

    import numpy as np
    import torch
    from torch import nn

    from hvd_spark.torch import TorchModel

    spark = job_session(a, "hvd_spark-torch-digits")
    try:
        train_df, test_df = digits_frames(spark)
        torch.manual_seed(1)
        common = dict(
            num_proc=a.num_proc,
            store=a.store,
            feature_cols=["features"],
            label_cols=["label"],
            validation=0.1,
            batch_size=a.batch_size,
            epochs=a.epochs,
            random_seed=1,
            task="classification",
        )
        if a.lightning:
            from hvd_spark.lightning import TorchEstimator as LightningEstimator

            est = LightningEstimator(model=lightning_net(), **common)
        else:
            from hvd_spark.torch import TorchEstimator

            model = digits_net()
            opt = torch.optim.Adam(model.parameters(), lr=0.002)
            est = TorchEstimator(model=model, optimizer=opt, loss=nn.CrossEntropyLoss(), **common)
        t0 = time.time()
        fitted = est.fit(train_df)
        print(
            f"fit: {time.time() - t0:.1f}s; history: { ({k: round(v[-1], 4) for k, v in fitted.getHistory().items()}) }"
        )
        rows = fitted.transform(test_df).select("label", "prediction").collect()
        accuracy = float(np.mean([r["label"] == r["prediction"] for r in rows]))
        print(f"test accuracy: {accuracy:.3f} on {len(rows)} rows")
        with tempfile.TemporaryDirectory() as d:
            fitted.write().save(os.path.join(d, "model"))
            loaded = TorchModel.load(os.path.join(d, "model"))
            again = loaded.transform(test_df).select("prediction").collect()
            assert [r["prediction"] for r in again] == [r["prediction"] for r in rows], "the loaded model differs"
        print("saved and loaded: the same predictions")
        if accuracy < 0.9:
            raise SystemExit(f"test accuracy {accuracy:.3f} is below 0.9")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
