#!/usr/bin/env bash
# Idempotent set-up of a Spark Connect client environment with no JVM, as a user of managed Spark
# has: pyspark-client of the default line's Spark version (no jars, no spark-submit),
# tensorflow-cpu (the client builds and saves the Keras model) and hvd_spark[cpu,connect-client].
# No full pyspark and no Horovod: the ranks run on the Connect server's side.
# tests/test_client_only.py runs it and then fits and transforms from it against a local Connect
# server started from the default line's .venv. It prints one line; pip's output goes to
# $HVD_SPARK_CACHE/logs/setup-<venv>.log (tail and path printed on a failure).
#
# pyspark-client of exactly the server's version comes from the package index when it has it;
# otherwise (the index here serves pyspark 4.3.0 but pyspark-client only up to 4.2.0) it is built
# once from the pyspark sdist of that version with Apache's own client packaging (setup.py of the
# newest pyspark-client sdist: the pyspark package without deps/ (jars, bin) and lib/ (py4j)) and
# kept in $HVD_SPARK_CACHE/wheels.
#
# Settings (environment):
#   HVD_SPARK_CLIENT_VENV  the environment (default: .venv-client)
#   HVD_SPARK_PYTHON       the interpreter (as for setup.sh); it must be the server's Python
#                          version (cloudpickle carries functions between them). The path stays
#                          .venv-client (tests/test_client_only.py uses it); its stamp holds the Python
#                          version, so a client environment of another version is made anew.
#   HVD_SPARK_CACHE        where the built pyspark-client wheel and the log are kept (default ~/.cache/hvd_spark)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_paths.sh"  # PY (HVD_SPARK_PYTHON) and DEFAULT_LINE
VENV="${HVD_SPARK_CLIENT_VENV:-$ROOT/.venv-client}"
CACHE="${HVD_SPARK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_spark}"
CONSTRAINTS="$ROOT/constraints/spark-$DEFAULT_LINE.txt"
SPARK_VERSION=$(sed -n 's/^pyspark==//p' "$CONSTRAINTS")
[ -n "$SPARK_VERSION" ] || { echo "setup_client: no pyspark==<version> line in $CONSTRAINTS" >&2; exit 2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup_client $(date +%H:%M:%S)] $*"; }
mkdir -p "$CACHE/logs"
LOG="$CACHE/logs/setup-$(basename "$VENV").log"
failed() {
  echo "setup_client: FAILED: $1. The last lines of the log:" >&2
  tail -n 30 "$LOG" | sed 's/^/  | /' >&2
  echo "setup_client: full log: $LOG" >&2
  exit 1
}
quiet() {
  local what=$1; shift
  echo "--- $what: $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 || failed "$what"
}

PY_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
  || { echo "setup_client: the interpreter $PY (HVD_SPARK_PYTHON) does not run." >&2; exit 2; }
stamp="$VENV/.hvd_spark-client-stamp"
want="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)-py$PY_VERSION"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  log "client environment up to date in $VENV (pyspark-client $SPARK_VERSION, Python $PY_VERSION)"
  exit 0
fi
echo "=== scripts/setup_client.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) venv=$VENV pyspark-client=$SPARK_VERSION python=$PY_VERSION" > "$LOG"
t0=$(date +%s)
log "setting up $VENV with Python $PY_VERSION: pyspark-client $SPARK_VERSION, tensorflow-cpu, hvd_spark[cpu,connect-client] (log: $LOG)"
rm -rf "$VENV"
quiet "creating $VENV" "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
quiet "pip: build tools" "$VPY" -m pip install --upgrade pip "setuptools>=77,<80" wheel

client_wheels="$CACHE/wheels/pyspark_client-$SPARK_VERSION"
if ! ls "$client_wheels"/pyspark_client-"$SPARK_VERSION"-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if "$VPY" -m pip download --no-deps "pyspark-client==$SPARK_VERSION" -d "$tmp/dl" >> "$LOG" 2>&1; then
    mkdir -p "$client_wheels" && cp "$tmp/dl"/* "$client_wheels/"
  else
    log "the package index has no pyspark-client $SPARK_VERSION; building it from the pyspark $SPARK_VERSION sdist (once)"
    quiet "pip: pyspark $SPARK_VERSION sdist" \
      "$VPY" -m pip download --no-deps --no-binary :all: "pyspark==$SPARK_VERSION" -d "$tmp/dl"
    quiet "pip: the newest pyspark-client sdist (its packaging)" \
      "$VPY" -m pip download --no-deps --no-binary :all: "pyspark-client<$SPARK_VERSION" -d "$tmp/client"
    tar xzf "$tmp"/dl/pyspark-"$SPARK_VERSION".tar.gz -C "$tmp" --exclude='*/deps/*' --exclude='*/lib/*'
    tar xzf "$tmp"/client/pyspark_client-*.tar.gz -C "$tmp/client"
    src="$tmp/pyspark-$SPARK_VERSION"
    packaging=$(ls -d "$tmp"/client/pyspark_client-*/ | head -n 1)
    rm -rf "$src/deps" "$src/lib" "$src"/*.egg-info "$src/PKG-INFO"
    cp "$packaging/setup.py" "$packaging/setup.cfg" "$packaging/MANIFEST.in" "$src/"
    grep -Eq "^__version__.*[\"']$SPARK_VERSION[\"']" "$src/pyspark/version.py" || failed "pyspark/version.py is not $SPARK_VERSION"
    quiet "building pyspark-client $SPARK_VERSION" "$VPY" -m pip wheel --no-deps -w "$tmp/wheel" "$src"
    mkdir -p "$client_wheels" && cp "$tmp"/wheel/pyspark_client-*.whl "$client_wheels/"
  fi
  rm -rf "$tmp"; trap - EXIT
fi
# The constraints pin the default line's versions (tensorflow-cpu, pyarrow, numpy, grpcio, ...);
# their pyspark== line does not install pyspark, it only constrains it if something asked for it.
quiet "pip: the client stack" "$VPY" -m pip install -c "$CONSTRAINTS" --find-links "$client_wheels" \
  "pyspark-client==$SPARK_VERSION" -e "$ROOT[cpu,connect-client]"
quiet "checking that no full pyspark was installed" "$VPY" -c '
import importlib.metadata as m, importlib.util, os, sys
try:
    m.distribution("pyspark")
    sys.exit("the full pyspark distribution is installed")
except m.PackageNotFoundError:
    pass
pkg = os.path.dirname(importlib.util.find_spec("pyspark").origin)
assert not os.path.exists(os.path.join(pkg, "jars")), pkg
print("pyspark-client", m.version("pyspark-client"), "at", pkg)'
echo "$want" > "$stamp"
log "done in $(( $(date +%s) - t0 )) s; interpreter: $VPY"
