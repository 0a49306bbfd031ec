#!/usr/bin/env bash
# Shared set-up for launch/quickstart.sh and tests/run.sh: installs the Debian packages hotpath
# needs when any is missing (apt-get; as root, or through sudo), then configures and builds a
# CMake preset.
#
#   source launch/setup.sh; hp_install_deps; hp_build cpu
set -euo pipefail

HP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HP_PACKAGES=(g++ cmake ninja-build pkg-config libopenmpi-dev openmpi-bin libhdf5-openmpi-dev
             hdf5-tools libboost-program-options-dev libgtest-dev libopenblas-openmp-dev
             nlohmann-json3-dev python3 python3-pip python3-matplotlib)

# The asan preset's compiler, sanitizer and fuzzer runtimes and OpenMP for clang (tests/run.sh's
# sanitizer stage): hp_install_deps "${HP_SANITIZER_PACKAGES[@]}".
HP_SANITIZER_PACKAGES=(clang libclang-rt-dev libomp-dev)

hp_log() { echo "[setup] $*" >&2; }

# hp_install_deps [EXTRA_PACKAGE...]: HP_PACKAGES and the extra ones.
hp_install_deps() {
  local missing=()
  for p in "${HP_PACKAGES[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    hp_log "all packages present"
  else
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo >/dev/null || { hp_log "need root or sudo to install: ${missing[*]}"; return 1; }
      sudo="sudo"
    fi
    hp_log "installing: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  hp_python_matplotlib
  hp_python_sft
  hp_python_corpus
}

# The scaling sweeps plot with matplotlib: Debian's python3-matplotlib serves /usr/bin/python3;
# a python3 of its own first on PATH (a virtual environment, pyenv) gets it from PyPI.
hp_python_matplotlib() {
  python3 -c 'import matplotlib' 2>/dev/null && return 0
  hp_log "python3 ($(command -v python3)) lacks matplotlib: pip install matplotlib"
  python3 -m pip install -q matplotlib >&2 || hp_log "could not install matplotlib: the sweeps write no plots"
}

# launch/tools/sft_data.py and its tests (hf.sft.tool*, registered only where python3 has them)
# need tokenizers and h5py: from PyPI where missing.
hp_python_sft() {
  python3 -c 'import tokenizers, h5py, numpy' 2>/dev/null && return 0
  hp_log "python3 ($(command -v python3)) lacks tokenizers or h5py: pip install tokenizers h5py"
  python3 -m pip install -q tokenizers h5py >&2 ||
    hp_log "could not install tokenizers/h5py: the SFT data tool's tests are not registered"
}

# launch/tools/corpus.py reads Parquet through pyarrow (its test tools.corpus.parquet is
# registered only where python3 has it): from PyPI where missing.
hp_python_corpus() {
  python3 -c 'import pyarrow.parquet' 2>/dev/null && return 0
  hp_log "python3 ($(command -v python3)) lacks pyarrow: pip install pyarrow"
  python3 -m pip install -q pyarrow >&2 ||
    hp_log "could not install pyarrow: corpus.py reads no Parquet, tools.corpus.parquet not registered"
}

hp_nvcc() {
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc
  elif [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc
  fi
}

# The cuDNN frontend's C++ headers (header-only; PyPI's nvidia-cudnn-frontend wheel carries them)
# for the CUDA backend's cuDNN attention, unpacked into build/_deps/cudnn_frontend. Where they
# cannot be fetched the CUDA build goes on without cuDNN attention (CMake says so).
HP_CUDNN_FRONTEND_VERSION=1.32.0
hp_fetch_cudnn_frontend() {
  local dest="$HP_ROOT/build/_deps/cudnn_frontend"
  [ -f "$dest/include/cudnn_frontend.h" ] && return 0
  local wheels="$HP_ROOT/build/_deps/wheels"
  mkdir -p "$wheels"
  hp_log "fetching the cuDNN frontend headers (nvidia-cudnn-frontend==$HP_CUDNN_FRONTEND_VERSION)"
  if ! python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" \
      "nvidia-cudnn-frontend==$HP_CUDNN_FRONTEND_VERSION" >&2; then
    hp_log "could not fetch nvidia-cudnn-frontend: building without cuDNN attention"
    return 0
  fi
  python3 - "$wheels" "$dest.tmp" <<'PY'
import glob, sys, zipfile
wheel = sorted(glob.glob(sys.argv[1] + "/nvidia_cudnn_frontend-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}

# hp_build PRESET [TARGET...]: configure (once) and build with every core: the named targets,
# or all of them (tests included) when none is named.
hp_build() {
  local preset=$1
  shift
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  cd "$HP_ROOT"
  [ "$preset" = cuda ] && hp_fetch_cudnn_frontend
  hp_log "configuring and building preset '$preset'${1:+ (targets: $*)}"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$(nproc)" ${targets[@]+"${targets[@]}"}
}

# Open MPI refuses root unless told; ranks may outnumber cores on small machines.
hp_mpirun() {
  local flags=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
  mpirun "${flags[@]}" "$@"
}
