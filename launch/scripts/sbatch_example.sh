#!/bin/bash
# Multi-node training under Slurm: one task per GPU, MPI started by srun through PMIx, checkpoints
# with save-and-requeue before the time limit, and a requeue after node failures.
#
# Submit from the repository root (the log directory must exist):
#   mkdir -p logs && sbatch launch/scripts/sbatch_example.sh [config]
#   HOTPATH=<hotpath executable> (default: build/cuda/bin/hotpath)
#
#SBATCH --job-name=hotpath-train
# Two machines; every task is one rank.
#SBATCH --nodes=2
# One task per GPU: hotpath drives GPU <local rank> (SLURM_LOCALID).
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
# Host cores for each rank's data loader and copy threads.
#SBATCH --cpus-per-task=12
#SBATCH --time=04:00:00
# SIGUSR1 to this script 120 s before the time limit (B:); it passes the signal on to srun, which
# hands it to every task: hotpath finishes its step, saves a checkpoint and exits with status 75
# (requeue), which this script turns into a requeue. (Without B:, Slurm signals the tasks itself.)
#SBATCH --signal=B:USR1@120
# The job may go back to the queue (this script requeues it; Slurm may after a node failure).
#SBATCH --requeue
# A requeued run keeps the job id and appends to the same log.
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

set -uo pipefail

config=${1:-examples/configs/gptoss-20b.ini}
hotpath=${HOTPATH:-build/cuda/bin/hotpath}
# Checkpoints on a file system every node sees (one HDF5 file per checkpoint, docs/checkpoints.md).
ckpt_dir=${CHECKPOINT_DIR:-checkpoints/$SLURM_JOB_NAME}

echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES nodes, $SLURM_NTASKS ranks"

# --mpi=pmix        starts MPI in every task (hotpath sees PMIX_RANK and uses MPI for rank discovery)
# --kill-on-bad-exit=1  one failed task ends the step, so no rank waits on a dead peer
# --cpu-bind=cores  each task keeps the cores it was given
# --resume=auto     a requeued (or resubmitted) job continues from the newest committed checkpoint;
#                   the first run, with none there, starts from step 0
# Exit status 75: the ranks agreed on a SIGUSR1/SIGTERM, saved and committed a checkpoint (all of
# them pass a barrier after the commit, so --kill-on-bad-exit cannot cut the save short); this
# script requeues the job. Any other failure ends it (Slurm requeues after a node failure).
srun --mpi=pmix --kill-on-bad-exit=1 --cpu-bind=cores "$hotpath" train --config "$config" \
  --checkpoint_dir="$ckpt_dir" --checkpoint_every=500 --keep_last=3 --resume=auto &
srun_pid=$!
trap 'kill -USR1 "$srun_pid" 2>/dev/null' USR1
trap 'kill -TERM "$srun_pid" 2>/dev/null' TERM
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
exit $status
