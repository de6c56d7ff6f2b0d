#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not cluster" tests/test_run.py
set -euo pipefail
# The tests train torch and Lightning models too (tests/test_torch_*.py, test_lightning_*.py): the default
# line's venv gets those extras.
[ "${HVD_SPARK_SPARK:-4.3}" = "4.3" ] && export HVD_SPARK_EXTRAS="${HVD_SPARK_EXTRAS:-torch,lightning}"
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/python" -m pytest "$@"
