#!/usr/bin/env bash
# Quick start on a fresh Debian 12 machine: installs what is missing, builds the CPU preset and
# trains the tiny GPT-OSS-style demo (tiny-moe) on the synthetic source, whose entropy floor is
# known: the log's last line compares the loss with it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
hp_install_deps
hp_build cpu
cd "$HP_ROOT"
mkdir -p build/runs
exec build/cpu/bin/hotpath train --config examples/configs/tiny-moe.ini \
  --metrics_path build/runs/tiny-moe.jsonl "$@"
