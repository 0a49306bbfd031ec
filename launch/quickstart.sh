#!/usr/bin/env bash
# Quick start on a fresh Debian 12 machine: installs what is missing, builds the hotpath program
# of the CPU preset (only it: tests/run.sh builds the tests) and trains the tiny GPT-OSS-style
# demo (tiny-moe) on the synthetic source, whose entropy floor is known: the log's last line
# compares the loss with it. With mpirun present the demo runs on two
# ranks, one expert-parallel pair (ep_size=2), one thread each.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
hp_install_deps
hp_build cpu hotpath
cd "$HP_ROOT"
mkdir -p build/runs
args=(train --config examples/configs/tiny-moe.ini --metrics_path build/runs/tiny-moe.jsonl "$@")
if command -v mpirun >/dev/null 2>&1; then
  export OMP_NUM_THREADS=1
  hp_mpirun -np 2 -x OMP_NUM_THREADS build/cpu/bin/hotpath "${args[@]}" --ep_size=2
else
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # idle threads sleep at once
  build/cpu/bin/hotpath "${args[@]}"
fi
