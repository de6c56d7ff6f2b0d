#!/usr/bin/env bash
# Sets up (idempotent) and checks the code: ruff lint, ruff format and mypy on hvd_spark/
# (configured in pyproject.toml). Exits non-zero on any finding; `ruff check --fix` and
# `ruff format` (with .venv/bin/) fix most of them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"
echo "lint: ruff and mypy clean"
