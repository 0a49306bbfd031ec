#!/usr/bin/env bash
# Checkpoints end to end on the CPU backend (tiny-moe, 6 steps):
#  - 6 steps straight vs 3 steps + save + new process + resume + 3 steps: the same per-step losses
#    and byte-equal final parameters, m and v (dataset digests of `hotpath inspect`), at 1, 2
#    (ep=2) and 4 (dp=2 x ep=2) ranks; the serial write of a launch without MPI holds the same
#    bytes as the parallel write;
#  - resharding 4 ranks (dp=2 x ep=2) -> 2 ranks (ep=2) -> 1 rank continues the 4-rank losses
#    within 1e-6 relative;
#  - a rank SIGKILLed at each point inside a save (HOTPATH_FAULT=kill-save-POINT): the restarted
#    job resumes from the previous committed checkpoint and continues bitwise;
#  - a flipped byte, a truncated file, a garbage `latest`: detected and named, non-zero exit for
#    an explicit checkpoint, a logged fallback under resume=auto;
#  - SIGUSR1 to one rank only: every rank saves the same step and exits 75; the resumed run
#    continues bitwise.
#   checkpoint_cli.sh HOTPATH_BINARY SOURCE_DIR
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
# run NP EP ARGS...: one process for NP=1, else mpirun; 6 steps unless ARGS say --steps=.
run() {
  local np=$1 ep=$2
  shift 2
  [[ " $* " == *" --steps="* ]] || set -- --steps=6 "$@"
  if [ "$np" -eq 1 ]; then
    timeout 300 "$hp" "${common[@]}" "$@"
  else
    timeout 300 "${mpi[@]}" -np "$np" "$hp" "${common[@]}" --ep_size="$ep" "$@"
  fi
}
# Step and loss of every step, as printed (9 significant digits).
losses() { cat "$@" | grep -o '"step":[0-9]*,"loss":[^,]*'; }
# Digests of the parameter and optimizer datasets of a checkpoint (file or directory).
digests() { "$hp" inspect "$1" | grep -E '^  /(params|optim)/' | awk '{print $1, $5}'; }
same_digests() {
  local a b
  a=$(digests "$1") && b=$(digests "$2") && [ -n "$a" ] && [ "$a" = "$b" ]
}
# Max relative loss difference of steps present in both files, at most 1e-6.
close_losses() {
  join <(losses "$1" | tr -d '"' | sed 's/step://; s/,loss:/ /') \
       <(losses "$2" | tr -d '"' | sed 's/step://; s/,loss:/ /') | awk '
    { d = $2 - $3; if (d < 0) d = -d; r = d / ($3 < 0 ? -$3 : $3); if (r > m) m = r; c++ }
    END { if (c != 6) { print "steps " c; exit 1 } if (m > 1e-6) { print "max rel diff " m; exit 1 }
          print "max rel diff " m }'
}

# ---- straight vs save + resume, bitwise, at 1, 2 and 4 ranks ----------------------------------
for spec in 1:1 2:2 4:2; do
  np=${spec%:*}
  ep=${spec#*:}
  d="$work/np$np"
  run "$np" "$ep" --checkpoint_dir="$d/straight" --metrics_path="$d.s.jsonl" >"$d.s.log" 2>&1 &&
    run "$np" "$ep" --checkpoint_dir="$d/parts" --stop_at_step=3 --metrics_path="$d.a.jsonl" \
      >"$d.a.log" 2>&1 &&
    run "$np" "$ep" --checkpoint_dir="$d/parts" --resume=auto --metrics_path="$d.b.jsonl" \
      >"$d.b.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    fail "$np ranks runs (exit $rc): $(tail -3 "$d".*.log)"
    continue
  fi
  grep -q "resumed from .*step_00000003.h5 at step 3" "$d.b.log" ||
    fail "$np ranks: no resume line: $(tail -3 "$d.b.log")"
  if [ "$(losses "$d.a.jsonl" "$d.b.jsonl")" = "$(losses "$d.s.jsonl")" ] &&
     [ "$(losses "$d.s.jsonl" | wc -l)" -eq 6 ]; then
    pass "$np ranks (ep=$ep): 3 + resume + 3 steps have the losses of 6 straight steps"
  else
    fail "$np ranks losses: $(paste <(losses "$d.a.jsonl" "$d.b.jsonl") <(losses "$d.s.jsonl"))"
  fi
  if same_digests "$d/parts/step_00000006.h5" "$d/straight/step_00000006.h5"; then
    pass "$np ranks: final params, m and v byte-equal ($(digests "$d/straight" | wc -l) datasets)"
  else
    fail "$np ranks: final checkpoints differ"
  fi
done

# Serial write (launch without MPI: ep shards gathered, rank 0 writes) == parallel write.
rv="$work/rendezvous"
pids=()
for r in 0 1; do
  env -u OMPI_COMM_WORLD_RANK RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r timeout 300 "$hp" "${common[@]}" \
    --steps=6 --ep_size=2 --bootstrap="file:$rv" --stop_at_step=3 --checkpoint_dir="$work/tcp" \
    >"$work/tcp.$r.log" 2>&1 &
  pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
if [ $ok -eq 1 ] && grep -q "serial HDF5" "$work/tcp.0.log" &&
   same_digests "$work/tcp/step_00000003.h5" "$work/np2/parts/step_00000003.h5"; then
  pass "launch without MPI: serial write from rank 0 holds the bytes of the parallel write"
else
  fail "serial write: $(tail -n 3 "$work/tcp.0.log" "$work/tcp.1.log")"
fi

# ---- resharding 4 (dp=2 x ep=2) -> 2 (ep=2) -> 1 ----------------------------------------------
rs="$work/reshard"
if run 4 2 --checkpoint_dir="$rs" --stop_at_step=2 --metrics_path="$rs.1.jsonl" >"$rs.1.log" 2>&1 &&
   run 2 2 --checkpoint_dir="$rs" --stop_at_step=4 --resume=auto --metrics_path="$rs.2.jsonl" \
     >"$rs.2.log" 2>&1 &&
   run 1 1 --checkpoint_dir="$rs" --resume=auto --metrics_path="$rs.3.jsonl" >"$rs.3.log" 2>&1; then
  cat "$rs.1.jsonl" "$rs.2.jsonl" "$rs.3.jsonl" >"$rs.jsonl"
  if grep -q "saved by world=4 dp=2 ep=2" "$rs.2.log" && grep -q "saved by world=2 dp=1 ep=2" "$rs.3.log" &&
     r=$(close_losses "$rs.jsonl" "$work/np4.s.jsonl"); then
    pass "reshard 4 -> 2 -> 1 ranks continues the 4-rank run ($r)"
  else
    fail "reshard: ${r:-} $(grep -h "loaded" "$rs".*.log)"
  fi
else
  fail "reshard runs: $(tail -n 3 "$rs".*.log)"
fi

# ---- a rank killed inside a save ----------------------------------------------------------------
# Checkpoints every 2 steps; the save of step 4 is killed. Rank 1 dies in begin/data/close, rank 0
# (which commits) right after the rename, before `latest` moves.
for spec in begin:1 data:1 close:1 rename:0; do
  point=${spec%:*}
  victim=${spec#*:}
  d="$work/kill-$point"
  HOTPATH_FAULT="kill-save-$point:$victim:4" timeout 120 "${mpi[@]}" -x HOTPATH_FAULT -np 2 "$hp" \
    "${common[@]}" --steps=6 --ep_size=2 --checkpoint_every=2 --checkpoint_dir="$d" \
    --metrics_path="$d.a.jsonl" >"$d.a.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -q "kill-save-$point" "$d.a.log"; then
    fail "kill-save-$point: exit $rc: $(tail -3 "$d.a.log")"
    continue
  fi
  if [ "$(cat "$d/latest")" != "step_00000002.h5" ]; then
    fail "kill-save-$point: latest is '$(cat "$d/latest")'"
    continue
  fi
  [ "$point" != rename ] && [ -e "$d/step_00000004.h5" ] && fail "kill-save-$point: step 4 committed"
  if run 2 2 --checkpoint_every=2 --checkpoint_dir="$d" --resume=auto --metrics_path="$d.b.jsonl" \
       >"$d.b.log" 2>&1 &&
     grep -q "resumed from .*step_00000002.h5 at step 2" "$d.b.log" &&
     [ "$(losses "$d.b.jsonl")" = "$(losses "$work/np2.s.jsonl" | tail -4)" ] &&
     [ ! -e "$d/step_00000004.h5.tmp" ] &&
     same_digests "$d/step_00000006.h5" "$work/np2/straight/step_00000006.h5"; then
    pass "rank $victim killed at '$point' in a save (exit $rc): restart resumes from step 2, bitwise"
  else
    fail "kill-save-$point restart: $(tail -3 "$d.b.log"; ls "$d")"
  fi
done

# ---- damaged checkpoints --------------------------------------------------------------------------
# The 1-rank run left step 3 and step 6 in np1/parts.
damage() {  # damage NAME: a copy of np1/parts
  rm -rf "$work/$1"
  cp -r "$work/np1/parts" "$work/$1"
  echo "$work/$1"
}
d=$(damage flip)
# The middle byte of the file (tensor data) XOR 0x5a.
f="$d/step_00000006.h5"
off=$(( $(stat -c %s "$f") / 2 ))
byte=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
printf "$(printf '\\%03o' $(( byte ^ 0x5a )))" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
out=$("$hp" inspect "$d/step_00000006.h5" 2>&1)
rc=$?
if [ $rc -ne 0 ] && grep -q "CORRUPT.*step_00000006.h5 dataset '/.*'.*CRC-32C" <<<"$out"; then
  pass "flipped byte: inspect names the dataset, exit $rc"
else
  fail "flipped byte inspect (exit $rc): $(grep -v ' ok$' <<<"$out" | tail -3)"
fi
run 1 1 --resume="$d/step_00000006.h5" >"$d.x.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "error: resume: checkpoint .*step_00000006.h5 cannot be loaded.*dataset '/" "$d.x.log"; then
  pass "flipped byte: explicit resume fails naming file and dataset (exit $rc)"
else
  fail "flipped byte resume (exit $rc): $(tail -2 "$d.x.log")"
fi
if run 1 1 --checkpoint_dir="$d" --resume=auto --metrics_path="$d.jsonl" >"$d.a.log" 2>&1 &&
   grep -q "step_00000006.h5 is damaged or unreadable; falling back" "$d.a.log" &&
   grep -q "resumed from .*step_00000003.h5 at step 3" "$d.a.log" &&
   [ "$(losses "$d.jsonl")" = "$(losses "$work/np1.b.jsonl")" ]; then
  pass "flipped byte under resume=auto: logged fallback to step 3, bitwise continuation"
else
  fail "flipped byte auto: $(tail -3 "$d.a.log")"
fi

d=$(damage trunc)
truncate -s 5000000 "$d/step_00000006.h5"
out=$("$hp" inspect "$d/step_00000006.h5" 2>&1)
rc=$?
run 1 1 --resume="$d/step_00000006.h5" >"$d.x.log" 2>&1
rc2=$?
if [ $rc -ne 0 ] && grep -q "step_00000006.h5.*truncated" <<<"$out" && [ $rc2 -ne 0 ] &&
   grep -q "error: resume: checkpoint .*step_00000006.h5 cannot be loaded.*truncated" "$d.x.log"; then
  pass "truncated file: inspect (exit $rc) and explicit resume (exit $rc2) fail naming it"
else
  fail "truncated (exit $rc, $rc2): $out $(tail -2 "$d.x.log")"
fi
if run 1 1 --checkpoint_dir="$d" --resume=auto --stop_at_step=4 >"$d.a.log" 2>&1 &&
   grep -q "resumed from .*step_00000003.h5 at step 3" "$d.a.log"; then
  pass "truncated file under resume=auto: logged fallback to step 3"
else
  fail "truncated auto: $(tail -3 "$d.a.log")"
fi

d=$(damage garbage)
printf 'step_\x01\x02 garbage' >"$d/latest"
"$hp" inspect "$d" >"$d.i.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "$d/latest: contents .* are not the name of a committed checkpoint" "$d.i.log"; then
  pass "garbage latest: inspect DIR fails naming it (exit $rc)"
else
  fail "garbage latest inspect (exit $rc): $(cat "$d.i.log")"
fi
if run 1 1 --checkpoint_dir="$d" --resume=auto --steps=7 >"$d.a.log" 2>&1 &&
   grep -q "latest: contents .*; using the newest committed" "$d.a.log" &&
   grep -q "resumed from .*step_00000006.h5 at step 6" "$d.a.log"; then
  pass "garbage latest under resume=auto: logged, resumed from the newest committed file"
else
  fail "garbage latest auto: $(tail -3 "$d.a.log")"
fi

# Nothing to resume: auto starts fresh with a log line, an explicit path is an error.
run 1 1 --checkpoint_dir="$work/empty" --resume=auto --steps=1 >"$work/empty.log" 2>&1 &&
  grep -q "no committed checkpoint in .*starting from step 0" "$work/empty.log" &&
  pass "resume=auto with nothing saved starts fresh, logged" || fail "auto fresh: $(tail -2 "$work/empty.log")"
run 1 1 --resume="$work/none.h5" --steps=1 >"$work/none.log" 2>&1
rc=$?
[ $rc -ne 0 ] && grep -q "none.h5' does not exist" "$work/none.log" &&
  pass "resume from a missing path fails (exit $rc)" || fail "missing path: exit $rc"

# ---- eval ---------------------------------------------------------------------------------------
out=$("$hp" eval --config "$src/examples/configs/tiny-moe.ini" --seq_len=128 --batch_tokens=1024 \
        --checkpoint="$work/np1/straight" --batches=2 2>"$work/eval.log")
if grep -qE '^eval_loss=[0-9.]+ tokens=[0-9]+$' <<<"$out"; then
  pass "eval: $out"
else
  fail "eval: $out $(tail -2 "$work/eval.log")"
fi

# ---- SIGUSR1 to one rank ------------------------------------------------------------------------
d="$work/sig"
timeout 300 "${mpi[@]}" -np 2 "$hp" "${common[@]}" --steps=30 --ep_size=2 --checkpoint_dir="$d" \
  --metrics_path="$d.a.jsonl" >"$d.a.log" 2>&1 &
job=$!
target=""
for _ in $(seq 1 600); do
  if [ -z "$target" ]; then
    for p in $(pgrep -f "checkpoint_dir=$d" 2>/dev/null); do
      tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1" && target=$p
    done
  fi
  [ -n "$target" ] && [ "$(cat "$d.a.jsonl" 2>/dev/null | wc -l)" -ge 2 ] && break
  sleep 0.1
done
[ -n "$target" ] && kill -USR1 "$target"
wait $job
rc=$?
s0=$(grep -o "r0\] warning: preemption signal: stopping after step [0-9]*" "$d.a.log" | grep -o '[0-9]*$')
s1=$(grep -o "r1\] warning: preemption signal: stopping after step [0-9]*" "$d.a.log" | grep -o '[0-9]*$')
if [ $rc -eq 75 ] && [ -n "$s0" ] && [ "$s0" = "$s1" ] && [ "$s0" -lt 30 ] &&
   [ "$(cat "$d/latest")" = "$(printf 'step_%08d.h5' "$s0")" ]; then
  pass "SIGUSR1 to rank 1 only: both ranks saved step $s0 and exited 75"
else
  fail "SIGUSR1: exit $rc, steps '$s0' '$s1', target '$target': $(tail -3 "$d.a.log")"
fi
if run 2 2 --steps=30 --checkpoint_dir="$d" --resume=auto --metrics_path="$d.b.jsonl" >"$d.b.log" 2>&1 &&
   run 2 2 --steps=30 --metrics_path="$d.s.jsonl" >"$d.s.log" 2>&1 &&
   [ "$(losses "$d.a.jsonl" "$d.b.jsonl")" = "$(losses "$d.s.jsonl")" ]; then
  pass "resumed after preemption: 30 steps bitwise equal to the uninterrupted run"
else
  fail "resume after preemption: $(tail -3 "$d.b.log")"
fi

# ---- SIGTERM to a single process ----------------------------------------------------------------
d="$work/term"
timeout 300 "$hp" "${common[@]}" --steps=30 --checkpoint_dir="$d" --metrics_path="$d.a.jsonl" \
  >"$d.a.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do
  [ "$(cat "$d.a.jsonl" 2>/dev/null | wc -l)" -ge 2 ] && break
  sleep 0.1
done
kill -TERM "$job"
wait $job
rc=$?
st=$(grep -o "preemption signal: stopping after step [0-9]*" "$d.a.log" | grep -o '[0-9]*$')
if [ $rc -eq 75 ] && [ -n "$st" ] && [ "$(cat "$d/latest" 2>/dev/null)" = "$(printf 'step_%08d.h5' "$st")" ]; then
  pass "SIGTERM: saved step $st and exited 75"
else
  fail "SIGTERM: exit $rc, step '$st': $(tail -3 "$d.a.log")"
fi

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
