#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not cluster" tests/test_run.py
set -euo pipefail
# The tests train torch models too (tests/test_torch_*.py): the default line's venv gets the torch extra.
[ "${HVD_SPARK_SPARK:-4.3}" = "4.3" ] && export HVD_SPARK_EXTRAS="${HVD_SPARK_EXTRAS:-torch}"
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/python" -m pytest "$@"
