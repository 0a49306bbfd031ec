#!/bin/bash
# The CPU variant of sbatch_example.sh: tiny-moe on 2 ranks of one node, MPI started by srun
# through PMIx, save-and-requeue on a signal before the time limit. Runs on any Slurm cluster.
#
#   mkdir -p logs && sbatch launch/scripts/sbatch_cpu_example.sh [config [hotpath train flags...]]
#   sbatch --signal=B:USR1@110 --time=2 launch/scripts/sbatch_cpu_example.sh   # signal the script
#
# Environment: HOTPATH (default build/cpu/bin/hotpath), CHECKPOINT_DIR (default
# checkpoints/<job name>), METRICS_DIR (when set: each start writes its metrics JSONL to
# METRICS_DIR/metrics-start<N>.jsonl, N = SLURM_RESTART_COUNT or 0), FIRST_START_ARGS (more
# hotpath flags for the first start only, e.g. a slower simulated link so that a test's signal
# lands mid-run; any flag that leaves the numbers unchanged).
#
#SBATCH --job-name=hotpath-cpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
# SIGUSR1 60 s before the time limit, to this script (B:), which passes it on to the ranks.
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

set -uo pipefail

config=${1:-examples/configs/tiny-moe.ini}
[ $# -gt 0 ] && shift
hotpath=${HOTPATH:-build/cpu/bin/hotpath}
ckpt_dir=${CHECKPOINT_DIR:-checkpoints/$SLURM_JOB_NAME}
start=${SLURM_RESTART_COUNT:-0}

echo "job $SLURM_JOB_ID start: SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-unset}, $SLURM_NTASKS ranks"
extra=()
[ -n "${METRICS_DIR:-}" ] && extra+=("--metrics_path=$METRICS_DIR/metrics-start$start.jsonl")
# shellcheck disable=SC2206
[ -z "${SLURM_RESTART_COUNT:-}" ] && extra+=(${FIRST_START_ARGS:-})

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
srun --mpi=pmix --kill-on-bad-exit=1 "$hotpath" train --config "$config" \
  --checkpoint_dir="$ckpt_dir" --checkpoint_every=100000 --resume=auto "${extra[@]}" "$@" &
srun_pid=$!
# A signal for the script (--signal=B:...) goes on to srun, which hands it to every rank; the
# ranks finish the step, save and exit 75.
forward() { echo "signal $1: passing it to the ranks"; kill -"$1" "$srun_pid" 2>/dev/null; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
status=0
while :; do
  wait "$srun_pid"
  status=$?
  # wait returns early (status > 128) when a trapped signal arrives; srun still runs then.
  kill -0 "$srun_pid" 2>/dev/null || break
done
if [ $status -eq 75 ]; then
  echo "preempted: checkpoint saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "job $SLURM_JOB_ID ended: status $status"
exit $status
