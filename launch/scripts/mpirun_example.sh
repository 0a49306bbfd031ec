#!/usr/bin/env bash
# Trains the tiny MoE demo on N ranks of this machine under mpirun.
#
# Usage: launch/scripts/mpirun_example.sh [ranks] [more `hotpath train` flags...]
#   HOTPATH  the hotpath executable   (default: <repo>/build/cpu/bin/hotpath)
#   CONFIG   the training config      (default: <repo>/examples/configs/tiny-moe.ini)
# Each rank learns its rank and the world size from mpirun's environment (OMPI_COMM_WORLD_*), so
# no --bootstrap flag is needed.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
ranks=${1:-2}
if [[ $# -gt 0 ]]; then shift; fi
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [ranks] [hotpath train flags...]  (ranks: a positive integer, got '$ranks')" >&2
  exit 2
fi
hotpath=${HOTPATH:-$root/build/cpu/bin/hotpath}
config=${CONFIG:-$root/examples/configs/tiny-moe.ini}

args=(-np "$ranks")
# Open MPI refuses to start as root unless told that it is intended (containers often run as root).
if [[ $(id -u) -eq 0 ]]; then args+=(--allow-run-as-root); fi
# More ranks than cores: allow it, and do not pin several ranks to one core.
cores=$(nproc)
if ((ranks > cores)); then args+=(--oversubscribe --bind-to none); fi
# The CPU backend runs OpenMP threads inside every rank: share the cores out between the ranks.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / ranks > 0 ? cores / ranks : 1))}

set -x
exec mpirun "${args[@]}" -x OMP_NUM_THREADS "$hotpath" train --config "$config" "$@"
