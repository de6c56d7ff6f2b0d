"""Elastic training of a torch model on a real cluster (issue 48): ``local-cluster`` with three executor
JVMs, one executor killed with SIGKILL in the middle of an epoch, as ``test_elastic.py`` does for Keras.

The fit goes on with two ranks from its latest commit inside the epoch (the data cursor), and grows back
to three at the next epoch end after the executor returns. Per epoch, from the ranks' data trace, no row
is trained twice and at most ``size - 1`` are left out.
"""

import pytest
from test_elastic import elastic_script, run_and_check

pytest.importorskip("torch")
pytestmark = pytest.mark.cluster

SCRIPT = elastic_script(
    "import torch\nfrom hvd_spark.torch import TorchEstimator",
    """
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.tensor([1.0 / ROWS, 1.0])
            self.dense = torch.nn.Linear(2, 1)

        def forward(self, x):
            if self.training:
                time.sleep(0.03)  # slow steps: the executor is killed in the middle of an epoch
            return self.dense(x * self.scale)
    """,
    """
    torch.manual_seed(0)
    model = Net()
    est = TorchEstimator(
        store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=EPOCHS,
        shuffle=True, shuffle_buffer_size=300, min_num_proc=2, max_num_proc=3, max_restarts=2,
        checkpoint_every=10, elastic_timeout=300, verbose=1, run_id="elastic",
    )
    """,
)


def test_a_killed_executor_shrinks_a_torch_fit_and_its_return_grows_it(tmp_path):
    run_and_check(SCRIPT, tmp_path)
