#!/usr/bin/env bash
# Runs one GPU case of CTest (tests/gpu/gpu_cases.cmake) where it can run, and skips it otherwise:
#
#   gpu_case.sh GPUS [--python-module NAME]... [--clean PATH]... -- COMMAND...
#
# Exits 77 (the cases' SKIP_RETURN_CODE), printing why, when the build has no CUDA backend
# (HP_GPU_BUILD=0), when fewer than GPUS CUDA devices are visible (the driver's list, limited by
# CUDA_VISIBLE_DEVICES), or when python3 cannot import a module NAME. Otherwise removes each PATH
# (creating its parent directory) and runs COMMAND; its exit status is the case's.
set -uo pipefail
need=${1:?usage: gpu_case.sh GPUS [--python-module NAME]... [--clean PATH]... -- COMMAND...}
shift
modules=()
clean=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --python-module) modules+=("$2"); shift 2 ;;
    --clean) clean+=("$2"); shift 2 ;;
    *) echo "gpu_case.sh: unknown argument '$1' (valid: --python-module NAME, --clean PATH, --)" >&2; exit 2 ;;
  esac
done
[ "${1:-}" = -- ] || { echo "gpu_case.sh: no '-- COMMAND' given" >&2; exit 2; }
shift
skip() { echo "[gpu_case] skipped: $*"; exit 77; }

[ "${HP_GPU_BUILD:-1}" != 0 ] || skip "this build has no CUDA backend (configured with HOTPATH_CUDA=OFF)"
have=0
if [ -d /proc/driver/nvidia/gpus ]; then
  have=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 | wc -l)
fi
if [ "$have" -eq 0 ] && command -v nvidia-smi >/dev/null; then
  have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -cvE '^ *(-1)? *$' || true)
  [ "$visible" -lt "$have" ] && have=$visible
fi
[ "$have" -ge "$need" ] || skip "needs $need CUDA device(s), $have visible"
for m in "${modules[@]}"; do
  python3 -c "import $m" 2>/dev/null || skip "python3 cannot import $m"
done
for p in "${clean[@]}"; do
  rm -rf -- "$p"
  mkdir -p -- "$(dirname -- "$p")"
done
"$@"
