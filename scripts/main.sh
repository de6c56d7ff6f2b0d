#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job on local Spark: examples/digits.py (fit with 2
# Horovod ranks, per-epoch metrics, transform, held-out accuracy, save / load). Extra arguments
# go to the example (--epochs, --store, --num-proc, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/python" examples/digits.py "$@"
