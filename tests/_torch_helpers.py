"""What the torch tests share: a small classifier, its data as one Parquet file of one row group, the rows
in the order 2 ranks read them, and a ``TorchEstimator`` built on them. Its classes travel to the ranks by
value (the executors cannot import this module)."""

import os
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS, VAL_ROWS, B, FEATURES, CLASSES = 96, 32, 8, 6, 3
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def data(seed=0, rows=ROWS, val_rows=VAL_ROWS):
    """``rows + val_rows`` rows of ``FEATURES`` normal features and a class out of 3."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows + val_rows, FEATURES)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def write(tmp_path, x, y, rows=ROWS, name="table.parquet") -> str:
    """One Parquet file of one row group: ``features`` (arrays), ``label``, ``is_val`` (the rows after ``rows``)."""
    table = pa.table(
        {
            "features": pa.array(list(x), type=pa.list_(pa.float32())),
            "label": pa.array(y),
            "is_val": np.arange(len(x)) >= rows,
        }
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = str(tmp_path / name)
    pq.write_table(table, path, row_group_size=len(x))
    return path


def interleaved(n: int, size: int, batch: int = B) -> np.ndarray:
    """Row numbers in the order of a plain loop at ``size * batch``: batch k holds rank 0's batch k, then
    rank 1's (rank r reads the r-th contiguous share of the ``n`` rows)."""
    share = n // size
    starts = [r * share + k * batch for k in range(share // batch) for r in range(size)]
    return np.concatenate([np.arange(s, s + batch) for s in starts])


def plain_fit(model, opt, loss_fn, x, y, order, batch: int, epochs: int, val=None) -> dict:
    """A plain torch loop over the rows ``order`` of ``x`` / ``y`` in batches of ``batch``, ``epochs`` times.
    Returns the history: ``loss`` per epoch (its batches' losses weighted by their rows) and, with
    ``val=(x_val, y_val)``, ``val_loss`` (the loss of the whole validation set as one batch)."""
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    history: dict = {"loss": [], **({"val_loss": []} if val is not None else {})}
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            opt.zero_grad()
            loss = loss_fn(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        history["loss"].append(total / len(order))
        if val is not None:
            with torch.no_grad():
                history["val_loss"].append(float(loss_fn(model(torch.as_tensor(val[0])), torch.as_tensor(val[1]))))
    return history


def assert_matches(fitted, plain, want: dict, module=None, all_keys: bool = True) -> None:
    """The fit's history equals ``want`` (every key of it, and only those with ``all_keys``) and its module's
    weights (``module``: a part of it) equal ``plain``'s, to ``RTOL`` / ``ATOL``."""
    got = fitted.getHistory()
    if all_keys:
        assert set(got) == set(want), (sorted(got), sorted(want))
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=RTOL, atol=ATOL, err_msg=f"history[{key!r}]")
    trained = (module or fitted.getModel()).state_dict()
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)


def torch_estimator(store, model=None, lr=0.1, **params):
    """A ``TorchEstimator`` of ``model`` (default: ``Net`` seeded with 0) with SGD at ``lr`` unless
    ``optimizer`` is given, on the table of :func:`write` read in place in order; ``params`` override."""
    from hvd_spark.torch import TorchEstimator

    if model is None:
        torch.manual_seed(0)
        model = Net()
    if "optimizer" not in params:
        params["optimizer"] = torch.optim.SGD(model.parameters(), lr=lr)
    defaults = dict(
        num_proc=2,
        store=str(store) if isinstance(store, os.PathLike) else store,
        model=model,
        loss=nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        validation="is_val",
        batch_size=B,
        val_batch_size=B,
        shuffle=False,
        materialize="never",
        verbose=0,
    )
    return TorchEstimator(**{**defaults, **params})
