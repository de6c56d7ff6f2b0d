#!/usr/bin/env bash
# Idempotent set-up of everything hvd_spark needs, safe to rerun:
#   1. Debian packages, each only when missing: a Java runtime for Spark, OpenMPI for Horovod's MPI
#      controller, and what the venv and Horovod's build need (a C++ compiler and make, and for a
#      Debian/Ubuntu interpreter its python3.X-venv and python3.X-dev; cmake comes from pip in step 2);
#   2. a virtual environment with the pinned stack (constraints/spark-<line>.txt) and TensorFlow's CPU
#      build (extra `cpu`) or its CUDA build (extra `gpu`: see HVD_SPARK_GPU);
#   3. Horovod 0.28.1 built from its sdist against the installed TensorFlow, cached as a wheel;
#   4. a check that prints which Horovod controllers and tensor operations are available.
# It prints a few lines (what it does, the check); the full output of apt, pip and the Horovod build
# goes to $HVD_SPARK_CACHE/logs/setup-<venv>.log, whose tail and path are printed when a step fails.
#
# Settings (environment):
#   HVD_SPARK_SPARK   Spark line to install: 4.3 (default: pyarrow 26, numpy 2, hvd_spark's Arrow reader),
#                     4.0 (same pyarrow / numpy) or 3.5 (pyarrow 12, numpy 1.26, with Petastorm)
#   HVD_SPARK_PYTHON  interpreter: a path or a version (3.12: python3.12 on PATH or under pyenv); default python3
#   HVD_SPARK_VENV    virtual environment path (default: .venv, or .venv-spark<line>[-py<version>] otherwise)
#   HVD_SPARK_CACHE   where built Horovod wheels are kept (default: ~/.cache/hvd_spark)
#   HVD_SPARK_GPU     1: the `gpu` extra (tensorflow[and-cuda] in place of tensorflow-cpu) and Horovod
#                     with NCCL when CUDA and NCCL are found; 0: Horovod without NCCL; unset (auto): the
#                     `gpu` extra when the venv already holds the `tensorflow` distribution (swapped in as
#                     docs/gpu.md says), else `cpu`, and NCCL when found. 0 never swaps TensorFlow back.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_paths.sh"
GPU="${HVD_SPARK_GPU:-auto}"
case "$GPU" in
  0|1|auto) ;;
  *) echo "setup: HVD_SPARK_GPU must be 1, 0 or unset (auto). Received: '$GPU'." >&2; exit 2 ;;
esac
case "$SPARK_LINE" in
  4.3|4.0|3.5) ;;
  *) echo "setup: HVD_SPARK_SPARK must be 4.3, 4.0 or 3.5. Received: '$SPARK_LINE'." >&2; exit 2 ;;
esac
CACHE="${HVD_SPARK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_spark}"
CONSTRAINTS="$ROOT/constraints/spark-$SPARK_LINE.txt"
HOROVOD_VERSION=0.28.1
# The local version label marks hvd_spark's patched build (see the sed lines in step 3); the
# launcher reads it to know the multi-host Gloo fix is in.
HOROVOD_BUILD="$HOROVOD_VERSION+hvdspark.1"

log() { echo "[setup $(date +%H:%M:%S)] $*"; }
t0=$(date +%s)
mkdir -p "$CACHE/logs"
LOG="$CACHE/logs/setup-$(basename "$VENV").log"
echo "=== scripts/setup.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) venv=$VENV line=$SPARK_LINE" > "$LOG"
failed() {
  echo "setup: FAILED: $1. The last lines of the log:" >&2
  tail -n 30 "$LOG" | sed 's/^/  | /' >&2
  echo "setup: full log: $LOG" >&2
  exit 1
}
# quiet WHAT CMD...: runs CMD with its output in the log; on failure prints the log's tail and path.
quiet() {
  local what=$1; shift
  echo "--- $what: $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 || failed "$what"
}

# --- 1. Debian packages ---------------------------------------------------------------------
need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mpicc >/dev/null 2>&1 || need_apt+=(openmpi-bin libopenmpi-dev)
# iproute2 (ip netns, tc) and util-linux (unshare, taskset): the multi-host test hosts.
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
# Horovod's build: a C++ compiler and make (cmake is pip's, installed into the venv in step 2).
{ command -v g++ && command -v make; } >/dev/null 2>&1 || need_apt+=(build-essential)
# The interpreter's own venv support (ensurepip) and headers (Python.h, where sysconfig says they
# are): Debian/Ubuntu split them into python3.X-venv and python3.X-dev. Other interpreters (pyenv's,
# a python.org build) carry both, so apt is asked only for one whose base prefix is /usr.
py_info=$("$PY" - <<'PYEOF' 2>/dev/null || true
import importlib.util, os, sys, sysconfig
print("%d.%d" % sys.version_info[:2], sys.base_prefix,
      int(importlib.util.find_spec("ensurepip") is not None),
      int(os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))))
PYEOF
)
read -r py_ver py_base py_has_ensurepip py_has_headers <<<"${py_info:-? ? 1 1}"
if [ "$py_base" = /usr ]; then
  [ "$py_has_ensurepip" = 1 ] || need_apt+=("python$py_ver-venv")
  [ "$py_has_headers" = 1 ] || need_apt+=("python$py_ver-dev")
elif [ "$py_has_headers" != 1 ]; then
  log "WARNING: $PY has no Python.h (sysconfig's include directory): Horovod's build needs it; install the interpreter's headers."
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    quiet "apt-get update" apt-get update
    quiet "apt-get install" apt-get install -y --no-install-recommends "${need_apt[@]}"
  else
    log "WARNING: missing ${need_apt[*]} and cannot apt-get (not root, or no apt-get): Spark needs Java;" \
        "the venv needs ensurepip, Horovod's build a C++ compiler and Python.h; MPI is optional."
  fi
fi
command -v java >/dev/null 2>&1 || { echo "setup: Java is required for Spark and is not installed." >&2; exit 1; }

# --- 2. virtual environment and pinned stack ---------------------------------------------------
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.hvd_spark-line" 2>/dev/null || true)" != "$SPARK_LINE" ]; then
  # A venv of another line (e.g. one made before the default changed): packages such as Petastorm
  # would stay behind if it were upgraded in place, so it is made anew.
  log "$VENV holds another Spark line; recreating it for Spark $SPARK_LINE"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  quiet "creating $VENV" "$PY" -m venv "$VENV"
  echo "$SPARK_LINE" > "$VENV/.hvd_spark-line"
fi
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$VENV/.hvd_spark-stamp"
want=$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -c1-16)
# cpu: tensorflow-cpu; gpu: tensorflow[and-cuda]; spark: the full pyspark (pyproject.toml describes
# the extras, docs/install.md the other installs). The TensorFlow extra follows HVD_SPARK_GPU, or the
# venv's TensorFlow: one swapped for tensorflow[and-cuda] (docs/gpu.md) is kept, not overwritten by
# tensorflow-cpu on the next reinstall.
tf_installed=$("$VPY" - <<'PYEOF'
import importlib.metadata as m
for name in ("tensorflow-cpu", "tensorflow"):
    try:
        m.version(name)
        print(name, end=" ")
    except m.PackageNotFoundError:
        pass
PYEOF
)
tf_extra=cpu
tf_pin=()
if [ "$GPU" = 1 ] || [[ " $tf_installed" == *" tensorflow "* ]]; then
  tf_extra=gpu
  # The constraints pin tensorflow-cpu; the CUDA build is held to the same version.
  tf_pin=("tensorflow==$(sed -n 's/^tensorflow-cpu==//p' "$CONSTRAINTS")")
fi
extras="$tf_extra,spark,test,bench"
[ "$SPARK_LINE" = "3.5" ] && extras="$extras,petastorm"
[ "$SPARK_LINE" = "4.0" ] && extras="$extras,connect"
[ "$SPARK_LINE" = "4.3" ] && extras="$extras,connect,lint,mlflow,s3,test-s3"
# HVD_SPARK_EXTRAS: more extras (scripts/test.sh asks for torch on the default line; the main job does not).
[ -n "${HVD_SPARK_EXTRAS:-}" ] && extras="$extras,$HVD_SPARK_EXTRAS"
# Up to date when the same files were installed with these extras or more (the main job after the tests
# finds torch there, and installs nothing).
have=$(cat "$stamp" 2>/dev/null || true)
covered=1
[ "${have%%-*}" = "$want" ] || covered=0
for e in ${extras//,/ }; do [[ ",${have#*-}," == *",$e,"* ]] || covered=0; done
want="$want-$extras"
if [ "$covered" != 1 ]; then
  log "installing the Spark $SPARK_LINE stack into $VENV (extras: $extras)"
  if [ "$tf_extra" = gpu ] && [[ " $tf_installed" == *" tensorflow-cpu "* ]]; then
    # Both distributions write the same tensorflow/ package: the CPU build goes first, and with it any
    # tensorflow whose files it overwrote, so that the gpu extra installs TensorFlow's CUDA build whole.
    log "replacing tensorflow-cpu with tensorflow[and-cuda] (the gpu extra)"
    quiet "pip: removing tensorflow-cpu" "$VPY" -m pip uninstall -y tensorflow-cpu tensorflow
  fi
  quiet "pip: build tools" "$VPY" -m pip install --upgrade pip "setuptools>=77,<80" wheel "cmake<4"
  quiet "pip: the Spark $SPARK_LINE stack" "$VPY" -m pip install -c "$CONSTRAINTS" -e "$ROOT[$extras]" "${tf_pin[@]}"
  echo "$want" > "$stamp"
else
  log "Python stack up to date in $VENV"
fi

# --- 3. Horovod, built against this TensorFlow and cached --------------------------------------
tf_dist=$("$VPY" - <<'PYEOF'
import importlib.metadata as m
for name in ("tensorflow-cpu", "tensorflow"):
    try:
        print(name, m.version(name))
        break
    except m.PackageNotFoundError:
        pass
PYEOF
)
tf_version=${tf_dist#* }
py_tag=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if command -v mpicc >/dev/null 2>&1; then with_mpi=1; mpi_tag=mpi; else with_mpi=0; mpi_tag=nompi; fi
# GPUs: Horovod's NCCL operations when CUDA (nvcc) and NCCL (nccl.h) are installed and TensorFlow is
# its CUDA build (tensorflow[and-cuda], not tensorflow-cpu); HVD_SPARK_GPU=0 builds without. See docs/gpu.md.
cuda_home=${CUDA_HOME:-/usr/local/cuda}
nccl_include=""
for d in ${NCCL_HOME:+"$NCCL_HOME/include"} /usr/include "$cuda_home/include"; do
  if [ -f "$d/nccl.h" ]; then nccl_include=$d; break; fi
done
with_nccl=0
if [ "$GPU" != 0 ] && [ -x "$cuda_home/bin/nvcc" ] && [ -n "$nccl_include" ]; then
  if [ "${tf_dist%% *}" = "tensorflow-cpu" ]; then
    log "CUDA and NCCL found, but TensorFlow is the CPU build (tensorflow-cpu): Horovod is built without NCCL." \
        "For GPUs, rerun with HVD_SPARK_GPU=1: it installs tensorflow[and-cuda] in place of tensorflow-cpu (docs/gpu.md)."
  else
    with_nccl=1
    mpi_tag="$mpi_tag-nccl"
  fi
fi
wheel_dir="$CACHE/wheels/horovod-$HOROVOD_BUILD-tf$tf_version-$py_tag-$mpi_tag"
have_hvd=$("$VPY" - <<PYEOF 2>/dev/null || true
import importlib.metadata as m
try:
    print("yes" if m.version("horovod") == "$HOROVOD_BUILD" else "no")
except m.PackageNotFoundError:
    print("no")
PYEOF
)
hvd_stamp="$VENV/.horovod-stamp"
if [ "$have_hvd" != "yes" ] || [ "$(cat "$hvd_stamp" 2>/dev/null || true)" != "$wheel_dir" ]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_BUILD against TensorFlow $tf_version (gloo, mpi=$with_mpi, nccl=$with_nccl); takes a few minutes"
    log "  build output: $LOG"
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    quiet "pip: Horovod's sdist" "$VPY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    tar xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # xla_mpi_ops.cc includes XLA headers that moved in TF >= 2.16; it only serves
    # jit_compile=True on GPUs, so it is left out of the build.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    # Horovod 0.28.1 bug: a process set's Gloo device reads its own, never-set iface instead of
    # the global context's HOROVOD_GLOO_IFACE, so it binds to whatever gethostname() resolves to
    # (127.0.0.1 where /etc/hosts maps the hostname to loopback) and ranks on other hosts cannot
    # connect. Use the global context's interface, as the global/local/cross contexts do.
    gc="$src/horovod/common/gloo/gloo_context.cc"
    grep -q '^  device_attr.iface = gloo_iface_;$' "$gc"
    sed -i '/InitializeForProcessSet(const GlooContext& global_context,/,/CreateDevice/ s/^  device_attr.iface = gloo_iface_;$/  gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;/' "$gc"
    grep -q 'gloo_iface_ = global_context.gloo_iface_;' "$gc"
    sed -i "s/^__version__ = '$HOROVOD_VERSION'$/__version__ = '$HOROVOD_BUILD'/" "$src/horovod/__init__.py"
    grep -q "__version__ = '$HOROVOD_BUILD'" "$src/horovod/__init__.py"
    mpi_flag=HOROVOD_WITHOUT_MPI
    [ "$with_mpi" = 1 ] && mpi_flag=HOROVOD_WITH_MPI
    gpu_flags=()
    if [ "$with_nccl" = 1 ]; then
      gpu_flags=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_GPU=CUDA "HOROVOD_CUDA_HOME=$cuda_home"
                 "HOROVOD_NCCL_INCLUDE=$nccl_include" HOROVOD_NCCL_LINK=SHARED)
      [ -n "${NCCL_HOME:-}" ] && gpu_flags+=("HOROVOD_NCCL_LIB=$NCCL_HOME/lib")
    fi
    mkdir -p "$wheel_dir.tmp"
    quiet "building Horovod" env "${gpu_flags[@]}" HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 "$mpi_flag=1" MAKEFLAGS="-j$(nproc)" \
        PATH="$VENV/bin:$PATH" \
      "$VPY" -m pip wheel --no-build-isolation --no-deps -w "$wheel_dir.tmp" "$src"
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
    rm -rf "$build"; trap - EXIT
  else
    log "using cached Horovod wheel from $wheel_dir"
  fi
  quiet "pip: Horovod's wheel" "$VPY" -m pip install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  # Horovod's own requirements (without the pinned stack being touched).
  quiet "pip: Horovod's requirements" "$VPY" -m pip install -c "$CONSTRAINTS" cloudpickle psutil pyyaml packaging
  echo "$wheel_dir" > "$hvd_stamp"
else
  log "Horovod $HOROVOD_VERSION already installed from $wheel_dir"
fi

# --- 4. check ---------------------------------------------------------------------------------
echo "--- the build check" >> "$LOG"
check=$("$VPY" -m hvd_spark.check_build 2>> "$LOG") || { echo "$check" >> "$LOG"; failed "the build check"; }
echo "$check" | tee -a "$LOG"
log "done in $(( $(date +%s) - t0 )) s; interpreter: $VPY"
