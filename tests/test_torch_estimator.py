"""TorchEstimator against plain torch (issue 48's differential suite): real Spark ``local[2]``, real ranks
joined by ``torch.distributed`` over Gloo (DistributedDataParallel), real Parquet and checkpoints.

The table is one Parquet file of one row group read in place with ``shuffle=False``: rank r reads the
r-th contiguous half of the training rows, so a plain torch loop at 2B given the rows interleaved by
blocks of B sees, in its batch k, rank 0's batch k then rank 1's. DDP averages the ranks' gradients of
their mean losses: the gradient of the mean over the 2B rows. So the weights and every epoch's loss
must match to 1e-5. One rank at B must equal the plain loop at B on the rows in their order.
"""

import os
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

sys.path.insert(0, os.path.dirname(__file__))
from _torch_helpers import (  # noqa: E402
    ATOL,
    CLASSES,
    FEATURES,
    ROWS,
    RTOL,
    VAL_ROWS,
    B,
    Net,
    assert_matches,
    plain_fit,
    torch_estimator,
)
from _torch_helpers import data as _data  # noqa: E402
from _torch_helpers import interleaved as _interleaved  # noqa: E402
from _torch_helpers import write as _write  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the models' classes travel by value


def _optimizer(name, params):
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=0.01),
        "adamw": lambda: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    }[name]()


def _plain(x, y, opt_name, size, epochs):
    """A plain torch loop in this process at batch size * B over the rows as the ranks read them."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(opt_name, model.parameters())
    val = (x[ROWS:], y[ROWS:])
    history = plain_fit(model, opt, nn.CrossEntropyLoss(), x, y, _interleaved(ROWS, size), size * B, epochs, val)
    model.plain_optimizer = opt  # for the tests of getOptimizer
    return model, history


def _fit(spark, tmp_path, path, opt_name, size, epochs, net=Net, **params):
    torch.manual_seed(0)
    model = net()
    est = torch_estimator(
        tmp_path / "store",
        model=model,
        optimizer=_optimizer(opt_name, model.parameters()),
        num_proc=size,
        epochs=epochs,
        **params,
    )
    fitted = est.fit(spark.read.parquet(path))
    assert len({r.weights_digest for r in fitted.getFitSummary().ranks}) == 1, fitted.getFitSummary().ranks
    return fitted


_assert_equal = assert_matches


def test_one_rank_equals_plain_torch(spark, tmp_path):
    x, y = _data()
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, "sgd", 1, epochs=2)
    fitted = _fit(spark, tmp_path, path, "sgd", 1, epochs=2)
    _assert_equal(fitted, plain, want)
    assert fitted.getFitSummary().ranks[0].iterations == 2 * ROWS // B


class DoublesItsInput(Net):
    """``Net`` on twice its input, doubled in place (as ``x.div_(255)`` would scale an image)."""

    def forward(self, x):
        return super().forward(x.mul_(2.0))


def test_a_module_editing_its_input_in_place_edits_its_own_copy(spark, tmp_path):
    """The rank's batches are views of the Arrow tables it reads (and keeps, with inmemory_cache_all):
    a module that edits its input in place must get its own copy, or every epoch after the first trains
    on the edited rows (4x, 8x). So the fit equals plain torch on 2x in every epoch."""
    x, y = _data(3)
    path = _write(tmp_path, x, y)
    plain, want = _plain(2.0 * x, y, "sgd", 1, epochs=3)
    fitted = _fit(spark, tmp_path, path, "sgd", 1, epochs=3, net=DoublesItsInput, inmemory_cache_all=True)
    _assert_equal(fitted, plain, want)
    rows = fitted.transform(spark.read.parquet(path).where("is_val")).collect()
    with torch.no_grad():  # transform's batches too: the module's output on 2x
        logits = plain(torch.as_tensor(np.stack([r["features"] for r in rows]).astype("float32") * 2.0)).numpy()
    np.testing.assert_allclose(np.stack([r["label__output"] for r in rows]), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_two_ranks_equal_plain_torch_at_the_global_batch(spark, tmp_path, opt):
    x, y = _data(1)
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, opt, 2, epochs=2)
    fitted = _fit(spark, tmp_path, path, opt, 2, epochs=2)
    _assert_equal(fitted, plain, want)
    # the optimizer stepped once per global batch, on both ranks
    assert [r.iterations for r in fitted.getFitSummary().ranks] == [2 * ROWS // (2 * B)] * 2


def test_resume_continues_as_one_fit_and_transform(spark, tmp_path):
    """A run fitted for 1 epoch then resumed to 3 equals 3 epochs at once (the optimizer's state and the
    step count come back from the checkpoint); its model predicts in transform as the module does."""
    from hvd_spark.torch import TorchModel

    x, y = _data(2)
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, "adam", 2, epochs=3)
    _fit(spark, tmp_path, path, "adam", 2, epochs=1, run_id="resumed")
    fitted = _fit(spark, tmp_path, path, "adam", 2, epochs=3, run_id="resumed")
    _assert_equal(fitted, plain, want)
    assert [r.start_iterations for r in fitted.getFitSummary().ranks] == [ROWS // (2 * B)] * 2

    df = spark.read.parquet(path).where("is_val")
    rows = fitted.transform(df).orderBy("label").collect()
    assert {"label__output", "prediction", "probability", "rawPrediction"} <= set(rows[0].asDict())
    with torch.no_grad():
        logits = plain(torch.as_tensor(np.stack([r["features"] for r in rows]).astype("float32"))).numpy()
    np.testing.assert_allclose(np.stack([r["label__output"] for r in rows]), logits, rtol=1e-5, atol=1e-5)
    assert [r["prediction"] for r in rows] == logits.argmax(1).astype(float).tolist()

    opt, module = fitted.getOptimizer(), fitted.getModel()  # the checkpoint's state, on getModel's parameters
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["params"] == list(module.parameters())
    for p_plain, p in zip(plain.parameters(), module.parameters()):
        want_state, got_state = plain.plain_optimizer.state[p_plain], opt.state[p]
        assert float(got_state["step"]) == float(want_state["step"]) == 3 * ROWS // (2 * B)
        want_sq = want_state["exp_avg_sq"].numpy()
        np.testing.assert_allclose(got_state["exp_avg_sq"].numpy(), want_sq, rtol=1e-4, atol=1e-9)

    saved = str(tmp_path / "saved")
    fitted.write().save(saved)
    loaded = TorchModel.load(saved)
    again = loaded.transform(df).orderBy("label").collect()
    assert [r["prediction"] for r in again] == [r["prediction"] for r in rows]


class FailOnce(Net):
    """Net whose rank 1 fails once, at its ``at``-th training step, while ``flag`` exists."""

    def __init__(self, flag: str, at: int):
        super().__init__()
        self.flag, self.at, self.calls = flag, at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at and os.environ.get("RANK") == "1" and os.path.exists(self.flag):
                os.remove(self.flag)
                raise RuntimeError("injected failure of rank 1")
        return super().forward(x)


def test_a_restart_from_a_commit_inside_an_epoch_equals_plain_torch(spark, tmp_path):
    """Commits every 2 steps; rank 1 fails at step 3 of epoch 2 (its 9th step); the restart resumes at
    epoch 2 step 2 from the cursor, with the optimizer's state and the epoch's loss sums so far: the
    history and weights equal plain torch's 3 epochs at 2B."""

    x, y = _data(3)
    path = _write(tmp_path, x, y)
    plain, want = _plain(x, y, "adam", 2, epochs=3)
    flag = tmp_path / "fail-once"
    flag.write_text("1")
    torch.manual_seed(0)
    model = FailOnce(str(flag), at=9)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    est = torch_estimator(tmp_path / "store", model, optimizer=optimizer, epochs=3, checkpoint_every=2, max_restarts=1)
    fitted = est.fit(spark.read.parquet(path))
    assert not flag.exists()
    summary = fitted.getFitSummary()
    assert summary.restarts == 1
    assert "epoch 1 step 2" in summary.recoveries[0].resumed_from, summary.recoveries[0]
    _assert_equal(fitted, plain, want)


def test_a_run_refuses_another_model(spark, tmp_path):

    x, y = _data(4)
    path = _write(tmp_path, x, y)
    _fit(spark, tmp_path, path, "sgd", 1, epochs=1, run_id="one-model")

    class Wider(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(FEATURES, 32)
            self.out = nn.Linear(32, CLASSES)

        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))

    wider = Wider()
    est = torch_estimator(tmp_path / "store", wider, num_proc=1, epochs=2, run_id="one-model")
    with pytest.raises(ValueError, match="one-model"):
        est.fit(spark.read.parquet(path))


VOCAB, STEPS = 30, 5


class Bag(nn.Module):
    """A sparse nn.Embedding (its gradient is a sparse tensor) under a linear classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, sparse=True)
        self.out = nn.Linear(4, 2)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def test_a_sparse_embedding_on_two_ranks_equals_plain_torch(spark, tmp_path):
    """DDP all-reduces the sparse gradient of nn.Embedding(sparse=True): SGD at 2 x B equals plain torch at 2B."""

    rng = np.random.default_rng(5)
    n = ROWS + VAL_ROWS
    ids = rng.integers(0, VOCAB, size=(n, STEPS)).astype("int64")
    y = (ids.sum(1) % 2).astype("int64")
    ids_col = pa.array(list(ids), type=pa.list_(pa.int64()))
    table = pa.table({"ids": ids_col, "label": y, "is_val": np.arange(n) >= ROWS})
    path = str(tmp_path / "ids.parquet")
    pq.write_table(table, path, row_group_size=n)

    def make():
        torch.manual_seed(0)
        return Bag()

    plain = make()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    want = plain_fit(plain, opt, nn.CrossEntropyLoss(), ids, y, _interleaved(ROWS, 2), 2 * B, 2, (ids[ROWS:], y[ROWS:]))
    est = torch_estimator(tmp_path / "store", make(), lr=0.5, feature_cols=["ids"], epochs=2)
    assert_matches(est.fit(spark.read.parquet(path)), plain, want)


class Dropped(Net):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.hidden(x))))


def test_dropout_rank_0_draws_from_random_seed(spark, tmp_path):
    """The dropout rule (docs/torch.md): rank 0's generator is seeded with random_seed, as one process
    seeded with it after building the model: one rank with Dropout equals that plain loop; the masks of
    other ranks come from seeds of their own."""

    x, y = _data(6)
    path = _write(tmp_path, x, y)
    torch.manual_seed(0)
    plain = Dropped()
    opt, loss_fn = torch.optim.SGD(plain.parameters(), lr=0.1), nn.CrossEntropyLoss()
    torch.manual_seed(7)  # random_seed
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for start in range(0, ROWS, B):
        opt.zero_grad()
        loss_fn(plain(xt[start : start + B]), yt[start : start + B]).backward()
        opt.step()
    torch.manual_seed(0)
    model = Dropped()
    est = torch_estimator(tmp_path / "store", model, num_proc=1, epochs=1, random_seed=7)
    fitted = est.fit(spark.read.parquet(path))
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(fitted.getModel().state_dict()[name].numpy(), value.numpy(), rtol=RTOL, atol=ATOL)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))


def test_batchnorm_follows_its_documented_rule(spark, tmp_path):
    """BatchNorm on 2 ranks (docs/torch.md): each rank normalizes with its own batch's statistics (the
    gradients are the average of the two halves'), and the running statistics are rank 0's (DDP
    broadcasts them from rank 0 before every forward pass). Checked against that rule played in one
    process, to 1e-5, and against plain torch at 2B, from which it differs."""

    x, y = _data(8)
    path = _write(tmp_path, x, y)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    order, loss_fn = _interleaved(ROWS, 2), nn.CrossEntropyLoss()

    def played(per_rank: bool):
        torch.manual_seed(0)
        model = Normed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for start in range(0, ROWS, 2 * B):
                idx = order[start : start + 2 * B]
                opt.zero_grad()
                if per_rank:  # rank 1's half first, its running statistics then replaced by rank 0's
                    before = [b.clone() for b in model.norm.buffers()]
                    (loss_fn(model(xt[idx[B:]]), yt[idx[B:]]) / 2).backward()
                    with torch.no_grad():
                        for b, v in zip(model.norm.buffers(), before):
                            b.copy_(v)
                    (loss_fn(model(xt[idx[:B]]), yt[idx[:B]]) / 2).backward()
                else:
                    loss_fn(model(xt[idx]), yt[idx]).backward()
                opt.step()
        return model

    rule, plain = played(True), played(False)
    torch.manual_seed(0)
    model = Normed()
    fitted = torch_estimator(tmp_path / "store", model, epochs=2).fit(spark.read.parquet(path))
    trained = fitted.getModel().state_dict()
    for name, value in rule.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    assert not np.allclose(trained["norm.running_mean"].numpy(), plain.state_dict()["norm.running_mean"].numpy())


def test_accumulated_gradients_resume_where_one_fit_steps(spark, tmp_path):
    """backward_passes_per_step=4 over 6 steps an epoch: the epoch's last batch steps with what it holds
    (an accumulation never spans two epochs), so a run resumed after epoch 1 equals one fit of 2 epochs."""
    x, y = _data(9)
    path = _write(tmp_path, x, y)
    one = _fit(spark, tmp_path / "one", path, "adam", 2, epochs=2, backward_passes_per_step=4)
    _fit(spark, tmp_path / "two", path, "adam", 2, epochs=1, backward_passes_per_step=4, run_id="acc")
    two = _fit(spark, tmp_path / "two", path, "adam", 2, epochs=2, backward_passes_per_step=4, run_id="acc")
    assert [r.iterations for r in one.getFitSummary().ranks] == [2 * 2] * 2  # 6 steps: 4 + 2, twice
    np.testing.assert_allclose(two.getHistory()["loss"], one.getHistory()["loss"], rtol=RTOL, atol=ATOL)
    for name, value in one.getModel().state_dict().items():
        np.testing.assert_allclose(two.getModel().state_dict()[name].numpy(), value.numpy(), rtol=RTOL, atol=ATOL)


def test_bad_torch_params_are_refused_before_any_work(spark, tmp_path):
    from hvd_spark.torch import TorchEstimator, TorchModel

    x, y = _data(10)
    path = _write(tmp_path, x, y)
    df = spark.read.parquet(path).selectExpr("features", "label", "cast(label as float) as w")
    model = Net()
    common = dict(num_proc=1, store=str(tmp_path / "store"), model=model, feature_cols=["features"])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sample_weight_col"):
        TorchEstimator(
            optimizer=sgd,
            loss=lambda o, t: nn.functional.cross_entropy(o, t),
            label_cols=["label"],
            sample_weight_col="w",
            **common,
        ).fit(df)
    with pytest.raises(ValueError, match="model's parameters"):
        TorchEstimator(
            optimizer=torch.optim.SGD(Net().parameters(), lr=0.1),
            loss=nn.CrossEntropyLoss(),
            label_cols=["label"],
            **common,
        ).fit(df)
    with pytest.raises(ValueError, match="label_cols"):
        TorchEstimator(optimizer=sgd, loss=nn.CrossEntropyLoss(), label_cols=["label", "w"], **common).fit(df)
    with pytest.raises(ValueError, match="Keras"):
        TorchEstimator(class_weight={0: 1.0}, **common)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.pt"))

    est = TorchEstimator(optimizer=sgd, loss=nn.CrossEntropyLoss(), label_cols=["label"], epochs=3, **common)
    est.write().save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.getOrDefault("epochs") == 3
    opt, net = loaded.getOrDefault("optimizer"), loaded.getOrDefault("model")
    assert all(any(p is q for q in net.parameters()) for g in opt.param_groups for p in g["params"])
    assert TorchModel.__module__ == "hvd_spark.torch"


class StopOnce(Net):
    """Net whose rank 1 stops its own process (SIGSTOP: alive and silent) at its ``at``-th step, once."""

    def __init__(self, marker: str, at: int):
        super().__init__()
        self.marker, self.at, self.calls = marker, at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at and os.environ.get("RANK") == "1" and not os.path.exists(self.marker):
                import signal

                with open(self.marker, "w") as f:
                    f.write("stopped")
                os.kill(os.getpid(), signal.SIGSTOP)
        return super().forward(x)


def test_a_stopped_torch_rank_is_found_by_the_stall_watchdog_and_the_fit_restarts(spark, tmp_path):
    """The stall watchdog counts a torch rank's steps: rank 1 stopped in epoch 2 is reported after
    stall_timeout, the job restarts from the latest checkpoint, and every epoch is trained once."""
    from hvd_spark import Store

    x, y = _data(11)
    path = _write(tmp_path, x, y)
    marker = tmp_path / "stopped"
    torch.manual_seed(0)
    model = StopOnce(str(marker), at=9)
    est = torch_estimator(tmp_path / "store", model, epochs=4, run_id="stalled", max_restarts=1, stall_timeout=8)
    fitted = est.fit(spark.read.parquet(path))
    assert marker.exists()
    summary = fitted.getFitSummary()
    assert summary.restarts == 1 and "stall" in summary.recoveries[0].cause.lower(), summary.recoveries
    assert len(fitted.getHistory()["loss"]) == 4
    assert [c.epoch for c in Store(str(tmp_path / "store")).checkpoints("stalled")] == [1, 2, 3, 4]
    assert summary.ranks[0].iterations == 4 * ROWS // (2 * B)
