"""tests/ports/ holds horovod's examples with only the lines its headers list changed: undoing those
changes gives horovod v0.28.1's files, byte for byte (their SHA-256 below, taken from
https://github.com/horovod/horovod at tag v0.28.1)."""

import hashlib
import re
from pathlib import Path

import pytest

PORTS = Path(__file__).parent.parent / "ports"
ORIGINAL_SHA256 = {
    "keras_spark_mnist.py": "a23d55d81fc0b1265147695a95f39715259009c48a103e24bca9f8aa1773443b",
    "keras_spark_rossmann_estimator.py": "1cea56c9a6dd6ad670ee6eb9e4260e96d48be530fe2fd793c3b005da0361a016",
    "pytorch_spark_mnist.py": "8c89ae1100ffdee14921078556dd28c44459427672686c4f99938eb05848bfb8",
}
# The only edits a port may make: horovod's imports to hvd_spark's, and Keras 3's learning_rate=.
ALLOWED = {
    "import horovod.spark.keras as hvd": "import hvd_spark as hvd",
    "import horovod.spark.torch as hvd": "import hvd_spark.torch as hvd",
    "from horovod.spark.common.backend import SparkBackend": "from hvd_spark import SparkBackend",
    "from horovod.spark.common.store import Store": "from hvd_spark import Store",
    "from horovod.tensorflow.keras.callbacks import BestModelCheckpoint": (
        "from hvd_spark.keras import BestModelCheckpoint"
    ),
}


def _original(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    """The file without its header, with the header's listed changes undone; and those changes."""
    header, sep, body = text.partition("# " + "=" * 98 + "\n")
    assert sep, "the port's header ends with a line of '='"
    changes = re.findall(r"^#   line (\d+): (.*)\n#        -> (.*)$", header, re.MULTILINE)
    lines = body.split("\n")
    for number, before, after in changes:
        i = int(number) - 1
        assert lines[i].strip() == after
        lines[i] = lines[i].replace(after, before)
    return "\n".join(lines), [(int(n), b, a) for n, b, a in changes]


@pytest.mark.parametrize("name", sorted(ORIGINAL_SHA256))
def test_a_port_is_horovods_example_with_only_its_imports_changed(name):
    original, changes = _original((PORTS / name).read_text())
    assert hashlib.sha256(original.encode()).hexdigest() == ORIGINAL_SHA256[name]
    for _, before, after in changes:
        if "lr=" in before:  # Keras 2's optimizer argument
            assert after == before.replace("(lr=", "(learning_rate=")
        else:
            assert ALLOWED[before] == after
    assert sum(1 for _, before, _ in changes if before.startswith(("import horovod", "from horovod"))) >= 3
