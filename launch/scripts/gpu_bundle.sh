#!/usr/bin/env bash
# Packs programs built here so they run on a GPU host that has CUDA, NCCL and Open MPI of its own
# but not the rest of the build's libraries (Boost.Program_options, parallel HDF5, OpenBLAS):
#
#   launch/scripts/gpu_bundle.sh OUT_DIR PROGRAM...      e.g. launch/scripts/gpu_bundle.sh .gpu build/cuda/bin/*
#
# Copies each program to OUT_DIR/bin and each library it needs to OUT_DIR/lib, except the C/C++
# runtimes, CUDA, NCCL, MPI and the base system's crypto/network libraries (the host's own,
# ABI-compatible ones are used), and writes
# OUT_DIR/env.sh to source on that host. Also copies the repository's launch/ scripts and
# examples/configs next to the programs.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,11p' "$0"; exit 2; }
out=$1
shift
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
skip='/(libc|libm|libpthread|librt|libdl|libutil|ld-linux[^/]*|libstdc\+\+|libgcc_s|libgomp|libz|libudev|libcuda|libcudart|libcublas[^/]*|libnccl|libnvidia[^/]*|libmpi[^/]*|libopen-(rte|pal)|libpmix|libhwloc|libevent[^/]*|libucp|libucs|libuct|libfabric|libibverbs|librdmacm|libresolv|libcrypto|libssl|libgnutls|libunistring|libkrb5[^/]*|libk5crypto|libgssapi[^/]*|libsasl2|libnettle|libhogweed|libgmp|libp11-kit|libtasn1|libidn2|libpsl|librtmp|libnghttp2|libbrotli[^/]*|libffi|libzstd|libcom_err|libkeyutils)\.so'
for p in "$@"; do
  [ -f "$p" ] && [ -x "$p" ] || continue
  cp "$p" "$out/bin/"
  ldd "$p" | awk '/=> \//{print $3}' | grep -Ev "$skip" | while read -r lib; do
    cp -Ln "$lib" "$out/lib/" 2>/dev/null || true
  done
done
cat >"$out/env.sh" <<'ENV'
# Source on the GPU host: source OUT_DIR/env.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$here/bin:$PATH"
# The host's own CUDA, MPI and runtimes come first; the bundle fills in what it lacks.
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}:$here/lib"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
export NCCL_NVLS_ENABLE=0
ENV
du -sh "$out" | awk '{print "bundle: " $1 " in " $2}'
