# Sourced by main.sh and test.sh: runs the set-up, then points VENV at the environment for
# HVD_SPARK_SPARK / HVD_SPARK_PYTHON (see _paths.sh; HVD_SPARK_VENV overrides) and sets the
# variables every run needs.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/_paths.sh"
cd "$ROOT"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
