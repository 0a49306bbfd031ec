#!/usr/bin/env bash
# Multi-rank training on the CPU backend: dp=N, ep=N and dp=2 x ep=2 runs of tiny-moe match the
# single-rank losses on the same global batches (relative 1e-5); routing costs exactly one sync
# per MoE layer forward (bincount) or one per expert (per-expert baseline); a failing, killed or
# hanging rank ends the whole job non-zero, naming the rank, within the collective timeout; the
# env-only and SLURM launch paths with a file rendezvous give the same losses.
#   mpi_train.sh HOTPATH_BINARY SOURCE_DIR
set -uo pipefail
hp=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
mpi=(mpirun --oversubscribe -x OMP_NUM_THREADS -x OMP_WAIT_POLICY)
passes=0
fails=0
pass() { passes=$((passes + 1)); echo "ok: $*"; }
fail() { fails=$((fails + 1)); echo "FAIL: $*"; }
if ! command -v mpirun >/dev/null; then echo "mpirun not found"; exit 1; fi

common=(train --config "$src/examples/configs/tiny-moe.ini" --seq_len=128 --batch_tokens=1024
        --log_every=100)
losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1" | cut -d: -f3; }
# same_losses A B: per-step relative difference <= 1e-5 over all 20 steps.
same_losses() {
  paste <(losses "$1") <(losses "$2") | awk -v n=20 '
    { d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) m = r; c++ }
    END { if (c != n) { print "steps " c; exit 1 } if (m > 1e-5) { print "max rel diff " m; exit 1 }
          print "max rel diff " m }'
}

timeout 300 "$hp" "${common[@]}" --steps=20 --metrics_path="$work/ref.jsonl" >"$work/ref.log" 2>&1 ||
  { fail "single-rank reference: $(tail -3 "$work/ref.log")"; echo "$passes passed, $fails failed"; exit 1; }

for spec in "2:1" "2:2" "4:1" "4:4" "4:2"; do
  np=${spec%:*}
  ep=${spec#*:}
  name="np${np}_ep${ep}"
  if timeout 600 "${mpi[@]}" -np "$np" "$hp" "${common[@]}" --steps=20 --ep_size="$ep" \
       --metrics_path="$work/$name.jsonl" >"$work/$name.log" 2>&1; then
    if r=$(same_losses "$work/$name.jsonl" "$work/ref.jsonl"); then
      pass "$np ranks, dp=$((np / ep)) x ep=$ep match one rank ($r)"
    else
      fail "$np ranks ep=$ep: $r"
    fi
    if [ "$(grep -c '"routing":4,' "$work/$name.jsonl")" -eq 20 ]; then
      pass "$name: 4 routing syncs per step (one per MoE layer forward, none in backward)"
    else
      fail "$name routing syncs: $(head -1 "$work/$name.jsonl")"
    fi
  else
    fail "$name run: $(tail -5 "$work/$name.log")"
  fi
done

# The per-expert baseline: one sync per expert per MoE layer (8 experts x 4 layers).
timeout 300 "${mpi[@]}" -np 2 "$hp" "${common[@]}" --steps=2 --ep_size=2 --routing=per-expert \
  --metrics_path="$work/pe.jsonl" >"$work/pe.log" 2>&1
[ "$(grep -c '"routing":32,' "$work/pe.jsonl" 2>/dev/null || echo 0)" -eq 2 ] &&
  pass "per-expert baseline: 32 routing syncs per step" || fail "per-expert syncs: $(cat "$work/pe.jsonl" "$work/pe.log" | tail -3)"

# Failures: every rank must exit non-zero, promptly, with the failed rank named.
fault() {
  local kind=$1 pattern=$2
  local start=$SECONDS out rc
  out=$(HOTPATH_FAULT="$kind:1:3" timeout 120 "${mpi[@]}" -x HOTPATH_FAULT -np 2 "$hp" "${common[@]}" \
          --steps=20 --collective_timeout_s=5 2>&1)
  rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then
    fail "fault $kind: exit $rc after ${took}s"
  elif ! grep -qiE "$pattern" <<<"$out"; then
    fail "fault $kind: no /$pattern/ in: $(tail -5 <<<"$out")"
  else
    pass "fault $kind on rank 1: job exited $rc after ${took}s"
  fi
}
fault throw "r1\].*injected failure"
fault kill "rank 1"
fault hang "timed out"

# Launch without MPI: RANK/WORLD_SIZE/LOCAL_RANK, and SLURM_* variables, meeting through a file.
for how in env slurm; do
  rv="$work/rendezvous.$how"
  pids=()
  for r in 0 1; do
    if [ $how = env ]; then
      vars=(RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r)
    else
      vars=(SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=$r SLURM_NNODES=1)
    fi
    env -u OMPI_COMM_WORLD_RANK "${vars[@]}" timeout 300 "$hp" "${common[@]}" --steps=20 --bootstrap="file:$rv" \
      --metrics_path="$work/$how.$r.jsonl" >"$work/$how.$r.log" 2>&1 &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  if [ $ok -eq 1 ] && r=$(same_losses "$work/$how.0.jsonl" "$work/ref.jsonl"); then
    pass "$how launch with file rendezvous matches one rank ($r)"
  else
    fail "$how launch: $(tail -n 3 "$work/$how.0.log" "$work/$how.1.log")"
  fi
done

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
