#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not cluster" tests/test_run.py
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/python" -m pytest "$@"
