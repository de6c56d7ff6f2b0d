#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job on local Spark. Extra arguments go to the example.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
SPARK_LINE="${HVD_SPARK_SPARK:-3.5}"
if [ "$SPARK_LINE" = "3.5" ]; then VENV="${HVD_SPARK_VENV:-$ROOT/.venv}"; else VENV="${HVD_SPARK_VENV:-$ROOT/.venv-spark$SPARK_LINE}"; fi
cd "$ROOT"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$VENV/bin/python" examples/digits.py "$@"
