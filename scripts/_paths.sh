# Sourced by setup.sh and _venv.sh: which Spark line, which Python and which virtual environment.
#   HVD_SPARK_SPARK   4.3 (default), 4.0 or 3.5
#   HVD_SPARK_PYTHON  the interpreter: a path, or a version such as 3.12 (found as python3.12 on PATH or
#                     under pyenv); default python3
#   HVD_SPARK_VENV    the virtual environment (default .venv for the default line and Python,
#                     else .venv-spark<line>[-py<version>])
DEFAULT_LINE=4.3
SPARK_LINE="${HVD_SPARK_SPARK:-$DEFAULT_LINE}"
PY_SUFFIX=""
PY="${PYTHON:-python3}"
if [ -n "${HVD_SPARK_PYTHON:-}" ]; then
  if [ -x "$HVD_SPARK_PYTHON" ]; then
    PY="$HVD_SPARK_PYTHON"
  elif "python$HVD_SPARK_PYTHON" -c "import sys" >/dev/null 2>&1; then  # runs (not just a pyenv shim)
    PY="$(command -v "python$HVD_SPARK_PYTHON")"
  elif command -v pyenv >/dev/null 2>&1 && \
       found=$(ls -d "$(pyenv root)/versions/$HVD_SPARK_PYTHON"*/bin/python 2>/dev/null | sort -V | tail -n 1) && \
       [ -n "$found" ]; then
    PY="$found"
  else
    echo "setup: HVD_SPARK_PYTHON=$HVD_SPARK_PYTHON is neither an interpreter's path nor a Python version found" \
         "as python$HVD_SPARK_PYTHON or under pyenv." >&2
    exit 2
  fi
  PY_SUFFIX="-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
fi
if [ "$SPARK_LINE" = "$DEFAULT_LINE" ] && [ -z "$PY_SUFFIX" ]; then
  DEFAULT_VENV="$ROOT/.venv"
else
  DEFAULT_VENV="$ROOT/.venv-spark$SPARK_LINE$PY_SUFFIX"
fi
VENV="${HVD_SPARK_VENV:-$DEFAULT_VENV}"
