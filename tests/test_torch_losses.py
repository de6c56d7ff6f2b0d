"""Losses whose denominator is the batch's content, on 2 ranks, against plain torch at the global batch
(``rank/torch_losses.py``): a padded sequence's cross-entropy with ``ignore_index`` (each rank's rows
hold a different number of real tokens), with class weights, as a ``functools.partial`` of
``F.cross_entropy``, and summed (``reduction="sum"``). DDP alone averages the ranks' means (or sums), which
is not the global batch's gradient: these fail without the global denominators.

Real Spark ``local[2]``, real ranks over Gloo, one Parquet file read in place with ``shuffle=False``:
rank r reads the r-th contiguous half of the training rows, as in ``test_torch_estimator.py``.
"""

import functools
import os
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, os.path.dirname(__file__))
from _torch_helpers import RTOL, assert_matches, interleaved, plain_fit  # noqa: E402

ROWS, VAL_ROWS, B, T, VOCAB, CLASSES, PAD = 64, 24, 8, 7, 20, 4, -100


class Tagger(nn.Module):
    """A token tagger: one class score per position, as ``(batch, classes, positions)``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens))).permute(0, 2, 1)


def _data():
    """Sequences of 1 to T tokens padded with token 0 and label ``PAD``; rank 0's half is mostly short,
    rank 1's long, so the ranks' counts of real tokens differ in every batch; rank 0's first training and
    validation batches are padding only."""
    rng = np.random.default_rng(3)
    n = ROWS + VAL_ROWS
    lengths = np.where(np.arange(n) < ROWS // 2, rng.integers(1, 4, n), rng.integers(4, T + 1, n))
    lengths[:B] = 0  # rank 0's first batch is padding only (its own mean would be 0/0)
    lengths[ROWS : ROWS + 5] = 0  # and its first validation batch
    tokens = rng.integers(1, VOCAB, size=(n, T))
    real = np.arange(T)[None, :] < lengths[:, None]
    labels = np.where(real, tokens % CLASSES, PAD)
    return np.where(real, tokens, 0).astype("int64"), labels.astype("int64")


def _write(tmp_path, tokens, labels) -> str:
    table = pa.table(
        {
            "tokens": pa.array(list(tokens), type=pa.list_(pa.int64())),
            "tags": pa.array(list(labels), type=pa.list_(pa.int64())),
            "is_val": np.arange(len(tokens)) >= ROWS,
        }
    )
    path = str(tmp_path / "seq.parquet")
    pq.write_table(table, path, row_group_size=len(tokens))
    return path


LOSSES = {
    "weighted_module": lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 3.0])),
    "partial_function": lambda: functools.partial(F.cross_entropy, ignore_index=PAD),
    "sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
}


def _plain(tokens, labels, loss_fn, epochs):
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    val = (tokens[ROWS:], labels[ROWS:])
    return model, plain_fit(model, opt, loss_fn, tokens, labels, interleaved(ROWS, 2, B), 2 * B, epochs, val)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_content_normalised_loss_on_two_ranks_equals_plain_torch(spark, tmp_path, kind):
    from hvd_spark.torch import TorchEstimator

    tokens, labels = _data()
    path = _write(tmp_path, tokens, labels)
    plain, want = _plain(tokens, labels, LOSSES[kind](), epochs=2)
    torch.manual_seed(0)
    model = Tagger()
    est = TorchEstimator(
        num_proc=2,
        store=str(tmp_path / "store"),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        loss=LOSSES[kind](),
        feature_cols=["tokens"],
        label_cols=["tags"],
        validation="is_val",
        batch_size=B,
        val_batch_size=5,  # batches of another size than training's: val_loss is the whole set's
        epochs=2,
        shuffle=False,
        materialize="never",
        verbose=0,
    )
    df = spark.read.parquet(path)
    fitted = est.fit(df)
    assert_matches(fitted, plain, want)
    if kind == "sum":  # transform: the per-position scores of the module's forward pass, no class columns
        out = fitted.transform(df.limit(5)).toPandas()
        assert "prediction" not in out.columns, list(out.columns)
        with torch.no_grad():
            want_scores = plain(torch.as_tensor(tokens[:5])).numpy()
        got_scores = np.stack([np.asarray(v, dtype="float32").reshape(CLASSES, T) for v in out["tags__output"]])
        np.testing.assert_allclose(got_scores, want_scores, rtol=RTOL, atol=1e-5)


def test_a_lightning_module_with_global_batch_loss_equals_plain_torch(spark, tmp_path):
    """``global_batch_loss`` in a ``LightningModule``'s ``training_step``: the masked loss of 2 ranks is the
    global batch's (without it, Lightning's DDP averages the ranks' means)."""
    pl = pytest.importorskip("lightning.pytorch")
    from hvd_spark.lightning import TorchEstimator, global_batch_loss

    class LitTagger(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.tagger = Tagger()
            self.loss_fn = nn.CrossEntropyLoss()

        def forward(self, tokens):
            return self.tagger(tokens)

        def training_step(self, batch, batch_idx):
            return global_batch_loss(self.loss_fn, self(batch["tokens"]), batch["tags"])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.02)

    tokens, labels = _data()
    path = _write(tmp_path, tokens, labels)
    plain, _ = _plain(tokens, labels, nn.CrossEntropyLoss(), epochs=2)
    torch.manual_seed(0)
    est = TorchEstimator(
        num_proc=2,
        store=str(tmp_path / "store"),
        model=LitTagger(),
        feature_cols=["tokens"],
        label_cols=["tags"],
        validation="is_val",
        batch_size=B,
        epochs=2,
        shuffle=False,
        materialize="never",
        verbose=0,
    )
    fitted = est.fit(spark.read.parquet(path))
    assert_matches(fitted, plain, {}, module=fitted.getModel().tagger, all_keys=False)
