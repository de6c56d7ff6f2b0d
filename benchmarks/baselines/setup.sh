#!/usr/bin/env bash
# Creates the two virtual environments of the baseline runners (issue 28's overhead table),
# idempotently: a venv whose stamp file holds the same recipe string is left as it is.
#   bench/horovod-spark  the legacy stack: horovod.spark's KerasEstimator and horovod.run with
#                        Keras 2 (tf_keras), pyspark 3.5.9, pyarrow 10 (horovod.spark needs < 11),
#                        numpy 1.26, Petastorm; Horovod from the wheel scripts/setup.sh built and cached
#   bench/torch          Spark's TorchDistributor: pyspark 4.3.0 and the CPU torch wheel
# Both live under ${HVD_SPARK_CACHE:-$HOME/.cache/hvd_spark}/bench. Output of pip goes to
# bench/setup-<venv>.log. Settings: PYTHON (default python3.11), TORCH_WHEEL (default: the file
# in /opt/wheels, else torch from the index).
set -euo pipefail

CACHE="${HVD_SPARK_CACHE:-$HOME/.cache/hvd_spark}"
BENCH="$CACHE/bench"
PY="${PYTHON:-python3.11}"

# --- Horovod's wheel: built by the project's own set-up, against tensorflow-cpu 2.21.0 on cp311 ---
HVD_WHEEL=$(ls "$CACHE"/wheels/horovod-0.28.1+hvdspark.1-tf2.21.0-cp311-*/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$HVD_WHEEL" ]; then
  echo "baselines/setup: no cached Horovod wheel (horovod-0.28.1+hvdspark.1-tf2.21.0-cp311-*) under $CACHE/wheels." >&2
  echo "baselines/setup: run 'bash scripts/setup.sh' first (with python3.11): it builds and caches that wheel." >&2
  exit 1
fi
mkdir -p "$BENCH"
TORCH_WHEEL="${TORCH_WHEEL:-$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | head -n 1 || true)}"
TORCH_WHEEL="${TORCH_WHEEL:-torch}"

# make_venv NAME RECIPE: creates $BENCH/NAME unless its stamp says RECIPE is installed already;
# the installs are in the function install_NAME.
make_venv() {
  local name=$1 recipe=$2 dir="$BENCH/$1"
  if [ "$(cat "$dir/.stamp" 2>/dev/null || true)" = "$recipe" ]; then
    echo "baselines/setup: $name up to date"; return
  fi
  echo "baselines/setup: creating $dir (log: $BENCH/setup-$name.log)"
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  # In the background so that `set -e` holds inside (it is off for a function run as a condition).
  ( set -x; "install_${name//-/_}" "$dir/bin/python" ) > "$BENCH/setup-$name.log" 2>&1 &
  if ! wait $!; then
    tail -n 25 "$BENCH/setup-$name.log" >&2; echo "baselines/setup: $name FAILED" >&2; exit 1
  fi
  echo "$recipe" > "$dir/.stamp"
}

install_horovod_spark() {
  local vpy=$1
  "$vpy" -m pip install --upgrade pip "setuptools<80" wheel
  # One resolver call so that TF's own requirements cannot pull numpy 2 or a newer pyarrow.
  # tensorboard: tensorflow-cpu 2.21 no longer requires it, but horovod.spark's LocalStore
  # (save_runs=True by default) adds a TensorBoard callback on rank 0, which fails without it.
  "$vpy" -m pip install "tensorflow-cpu==2.21.0" "tensorboard==2.21.0" "numpy==1.26.4" "pyarrow==10.0.1" "pandas==2.1.4" \
    "pyspark==3.5.9" "petastorm==0.13.1" h5py scikit-learn cloudpickle psutil pyyaml packaging \
    "fsspec>=2021.07.0" pyzmq
  # tf_keras (Keras 2) without its requirement on the full `tensorflow` distribution (a second TF).
  "$vpy" -m pip install --no-deps "tf_keras==2.21.0"
  "$vpy" -m pip install --no-deps "$HVD_WHEEL"
  # horovod.spark.keras / horovod.tensorflow.keras do `from tensorflow import keras` and
  # `from keras import backend`: both must be Keras 2. The .pth runs at every interpreter start
  # of this venv (Spark's Python workers and Horovod's ranks too): it sets TF_USE_LEGACY_KERAS=1
  # (tf.keras -> tf_keras) and makes `keras` / `keras.*` the tf_keras modules themselves.
  local site; site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cat > "$site/_keras_is_tf_keras.py" <<'EOF'
"""Installed by benchmarks/baselines/setup.sh: `import keras` gives tf_keras (Keras 2) in this venv."""
import importlib, importlib.abc, importlib.util, os, sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "keras" or name.startswith("keras."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module("tf_keras" + spec.name[len("keras"):])
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module):
        pass


if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    sys.meta_path.insert(0, _Alias())
EOF
  echo "import _keras_is_tf_keras" > "$site/_keras_is_tf_keras.pth"
  "$vpy" -c "import keras, tf_keras, tensorflow as tf, horovod.tensorflow.keras, horovod.spark.keras; \
assert keras is tf_keras and tf.keras.__name__.startswith('tf_keras'), (keras, tf.keras)"
}

install_torch() {
  local vpy=$1
  "$vpy" -m pip install --upgrade pip "setuptools<80" wheel
  # pyspark 4.3 wants pyarrow >= 18 and pandas >= 2.2 (pandas 3 is not fully supported), the same
  # versions as the project's default line (constraints/spark-4.3.txt).
  "$vpy" -m pip install "$TORCH_WHEEL" "pyspark==4.3.0" "pyarrow==26.0.1" "pandas==2.3.3" "numpy==2.4.6" scikit-learn
  "$vpy" -c "import torch, torch.distributed, pyspark.ml.torch.distributor"
}

make_venv horovod-spark "tf2.21.0 tb2.21.0 pyspark3.5.9 pyarrow10.0.1 petastorm0.13.1 $(basename "$HVD_WHEEL")"
make_venv torch "pyspark4.3.0 pyarrow26.0.1 pandas2.3.3 numpy2.4.6 $(basename "$TORCH_WHEEL")"
echo "HOROVOD_SPARK_PYTHON=$BENCH/horovod-spark/bin/python"
echo "TORCH_PYTHON=$BENCH/torch/bin/python"
