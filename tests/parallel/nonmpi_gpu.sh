#!/bin/bash
# Two ranks on two GPUs launched without mpirun (RANK/WORLD_SIZE/LOCAL_RANK, as torchrun-style
# launchers set them), meeting through bootstrap=file:PATH: the store carries the control
# messages, NCCL the tensors, the checkpoint gathers included. tiny-moe at ep_size=2 with zero1,
# deterministic: 4 steps straight against 2 steps + save + two new processes + resume + 2 steps;
# the resumed steps' losses and gradient norms must be bitwise those of the straight run, and the
# save must have been written by rank 0 alone from the gathered tensors.
#
# usage: nonmpi_gpu.sh HOTPATH CONFIG WORKDIR PYTHON HP_CHECK_PY CUDA_BUILD(0|1)
# Exit status 77 (skip, with the reason) without a CUDA build or with fewer than 2 GPUs visible.
set -u
hp=$1 cfg=$2 work=$3 py=$4 check=$5 cuda=$6

skip() {
  echo "SKIPPED: $*"
  exit 77
}
fail() {
  echo "FAILED: $*"
  exit 1
}

[ "$cuda" = 1 ] || skip "this build has no CUDA (configure the cuda preset): the launch without MPI on 2 GPUs needs NCCL"
gpus=0
if [ -d /proc/driver/nvidia/gpus ]; then
  gpus=$(ls /proc/driver/nvidia/gpus | wc -l)
elif command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  visible=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -v '^ *$' | grep -vc '^ *-1')
  [ "$visible" -lt "$gpus" ] && gpus=$visible
fi
[ "$gpus" -ge 2 ] || skip "needs 2 visible GPUs, $gpus visible"

rm -rf "$work"
mkdir -p "$work"
run=(train --config "$cfg" --device=cuda --deterministic=true --steps=4 --ep_size=2
     --optimizer_sharding=zero1 --log_every=1)

# launch TAG ARGS...: ranks 0 and 1 as plain processes; both must exit 0.
launch() {
  local tag=$1
  shift
  local pids=() r rc=0
  for r in 0 1; do
    env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u SLURM_PROCID \
      -u SLURM_NTASKS RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
      HOTPATH_RENDEZVOUS_HOST=127.0.0.1 \
      "$hp" "${run[@]}" --bootstrap="file:$work/$tag.rendezvous" "$@" >"$work/$tag.$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || rc=1; done
  if [ $rc -ne 0 ]; then
    for r in 0 1; do
      echo "---- $tag rank $r (last lines) ----"
      tail -n 25 "$work/$tag.$r.log"
    done
    fail "the $tag run did not exit 0 on both ranks"
  fi
}

launch straight --metrics_path="$work/s.jsonl"
launch half --stop_at_step=2 --checkpoint_dir="$work/run" --metrics_path="$work/a.jsonl"
launch resumed --resume=auto --checkpoint_dir="$work/run" --metrics_path="$work/b.jsonl"

grep -q "launch: rank 0 of 2.*via env" "$work/half.0.log" || fail "rank 0 did not start as rank 0 of 2 via env (see $work/half.0.log)"
grep -q "serial HDF5 from rank 0" "$work/half.0.log" ||
  fail "the save of the launch without MPI was not written by rank 0 alone (see $work/half.0.log)"
grep -q "resume=auto: resumed from .*step_0*2.h5 at step 2" "$work/resumed.0.log" ||
  fail "the resumed run did not resume at step 2 (see $work/resumed.0.log)"
"$py" "$check" losses "$work/a.jsonl,$work/b.jsonl" "$work/s.jsonl" --same-steps --steps 4 ||
  fail "losses of the resumed run differ from the straight run"
"$py" "$check" losses "$work/a.jsonl,$work/b.jsonl" "$work/s.jsonl" --same-steps --steps 4 \
  --field grad_norm || fail "gradient norms of the resumed run differ from the straight run"
echo "PASSED: 2 ranks without MPI on 2 GPUs: save through NCCL gathers, resume bitwise"
