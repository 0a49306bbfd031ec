#!/usr/bin/env bash
# Packs a CUDA build so that a GPU host runs its GPU cases and benchmarks. The host has CUDA, NCCL,
# Open MPI, CMake/ctest and python3 of its own, but not the build's other libraries (Boost
# program_options, parallel HDF5, OpenBLAS); the repository's working tree arrives there too.
#
#   launch/scripts/gpu_bundle.sh OUT_DIR BUILD_DIR [PROGRAM...]
#   e.g. launch/scripts/gpu_bundle.sh .gpu build/cuda
#
# Writes OUT_DIR (replacing it), meant to sit in the repository root as .gpu/:
#   bin/                BUILD_DIR/bin/hotpath, gpu_tests and hp_hf_compare, and each PROGRAM
#   lib/                each shared library those programs load, except the C/C++ runtimes, CUDA,
#                       NCCL, MPI and the base system's crypto and network libraries (the host's
#                       own, ABI-compatible ones are used)
#   ctest/CTestTestfile.cmake
#                       every GPU case (label gpu): gpu_tests' GoogleTest cases and those of
#                       tests/gpu/gpu_cases.cmake (tests/gpu/bundle_ctest.cmake writes it), with
#                       paths relative to the bundle and the repository root
#   env.sh              to source on the host: bin/ on PATH, lib/ and PyTorch's cuDNN on
#                       LD_LIBRARY_PATH, Open MPI allowed to run as root
#   run_gpu_tests.sh    runs `ctest -L gpu` over ctest/ from the repository root
# Nothing else is copied: the scripts, configs and fixtures the cases read (tests/gpu/*.sh,
# tests/tools/hp_check.py, tests/hf/, examples/configs/) are those of the working tree.
# On the host, from the repository root:
#
#   source .gpu/env.sh && .gpu/run_gpu_tests.sh [CTEST_ARGS...]
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,25p' "$0"; exit 2; }
out=$1
build=$2
shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
programs=()
for p in hotpath gpu_tests hp_hf_compare; do
  [ -x "$build/bin/$p" ] || {
    echo "gpu_bundle.sh: $build/bin/$p is missing; build it first: cmake --build $build --target hotpath gpu_tests hp_hf_compare" >&2
    exit 2
  }
  programs+=("$build/bin/$p")
done
for p in "$@"; do
  if [ ! -f "$p" ] || [ ! -x "$p" ]; then
    echo "gpu_bundle.sh: PROGRAM '$p' is not an executable file" >&2
    exit 2
  fi
  programs+=("$p")
done

# Only a bundle is replaced; written next to OUT_DIR and moved into place whole, so an
# interrupted run leaves the old one.
if [ -e "$out" ] && [ ! -f "$out/env.sh" ]; then
  echo "gpu_bundle.sh: OUT_DIR '$out' exists and is not a bundle (no env.sh); remove it or name another" >&2
  exit 2
fi
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d "$(dirname "$out")/.gpu_bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/lib" "$tmp/ctest"
skip='/(libc|libm|libpthread|librt|libdl|libutil|ld-linux[^/]*|libstdc\+\+|libgcc_s|libgomp|libz|libudev|libcuda|libcudart|libcublas[^/]*|libnccl|libnvidia[^/]*|libmpi[^/]*|libopen-(rte|pal)|libpmix|libhwloc|libevent[^/]*|libucp|libucs|libuct|libfabric|libibverbs|librdmacm|libresolv|libcrypto|libssl|libgnutls|libunistring|libkrb5[^/]*|libk5crypto|libgssapi[^/]*|libsasl2|libnettle|libhogweed|libgmp|libp11-kit|libtasn1|libidn2|libpsl|librtmp|libnghttp2|libbrotli[^/]*|libffi|libzstd|libcom_err|libkeyutils)\.so'
for p in "${programs[@]}"; do
  cp "$p" "$tmp/bin/"
  ldd "$p" | awk '/=> \//{print $3}' | { grep -Ev "$skip" || true; } | while read -r lib; do
    [ -e "$tmp/lib/$(basename "$lib")" ] || cp -L "$lib" "$tmp/lib/"
  done
done

cmake -DGPU_TESTS="$build/bin/gpu_tests" -DOUT="$tmp/ctest/CTestTestfile.cmake" \
  -P "$root/tests/gpu/bundle_ctest.cmake"

cat >"$tmp/env.sh" <<'ENV'
# Source on the GPU host: source .gpu/env.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$here/bin:$PATH"
# The host's own CUDA, MPI and runtimes come first; the bundle fills in what it lacks.
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}:$here/lib"
# cuDNN: hotpath loads libcudnn.so.9 at run time; the host's PyTorch carries one.
cudnn_lib=$(python3 -c 'import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$cudnn_lib" ] && [ -d "$cudnn_lib" ] && export LD_LIBRARY_PATH="$cudnn_lib:$LD_LIBRARY_PATH"
unset cudnn_lib
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
export NCCL_NVLS_ENABLE=0
ENV

cat >"$tmp/run_gpu_tests.sh" <<'RUN'
#!/usr/bin/env bash
# Every GPU case of the bundle, from the repository root (or HP_SOURCE_DIR), after
# `source .gpu/env.sh`: ctest -L gpu over the bundle's ctest/, GPU_TEST_JOBS (default 4) at once;
# arguments go to ctest (e.g. -R gpu.ckpt, -LE sanitize).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${HP_SOURCE_DIR:-$(pwd)}
[ -f "$root/tests/gpu/gpu_cases.cmake" ] || {
  echo "run_gpu_tests.sh: $root is not the repository root (no tests/gpu/gpu_cases.cmake); run it from there or set HP_SOURCE_DIR" >&2
  exit 2
}
HP_SOURCE_DIR=$(cd "$root" && pwd) exec ctest --test-dir "$here/ctest" -L gpu --output-on-failure \
  -j "${GPU_TEST_JOBS:-4}" "$@"
RUN
chmod +x "$tmp/run_gpu_tests.sh"

rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
du -sh "$out" | awk '{print "gpu_bundle.sh: " $1 " in " $2}'
