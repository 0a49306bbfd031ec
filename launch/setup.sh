#!/usr/bin/env bash
# Shared set-up for launch/quickstart.sh and tests/run.sh: installs the Debian packages hotpath
# needs when any is missing (apt-get; as root, or through sudo), then configures and builds a
# CMake preset.
#
#   source launch/setup.sh; hp_install_deps; hp_build cpu
set -euo pipefail

HP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HP_PACKAGES=(g++ cmake ninja-build pkg-config libopenmpi-dev openmpi-bin libhdf5-openmpi-dev
             hdf5-tools libboost-program-options-dev libgtest-dev libopenblas-openmp-dev)

hp_log() { echo "[setup] $*" >&2; }

hp_install_deps() {
  local missing=()
  for p in "${HP_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    hp_log "all packages present"
    return 0
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { hp_log "need root or sudo to install: ${missing[*]}"; return 1; }
    sudo="sudo"
  fi
  hp_log "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

hp_nvcc() {
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc
  elif [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc
  fi
}

# hp_build PRESET: configure (once) and build with every core.
hp_build() {
  local preset=$1
  cd "$HP_ROOT"
  hp_log "configuring and building preset '$preset'"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$(nproc)"
}

# Open MPI refuses root unless told; ranks may outnumber cores on small machines.
hp_mpirun() {
  local flags=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
  mpirun "${flags[@]}" "$@"
}
