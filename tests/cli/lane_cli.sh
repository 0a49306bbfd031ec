#!/usr/bin/env bash
# Whole-program checks of the lane arbiter keys (lane_arbiter, lane_chunk_mib, lane_inflight,
# pcie_groups): bad values fail before any work with exit status 2 and a message naming the key;
# offload copies go through granted chunks (counted in the JSONL metrics: ceil(block / chunk)
# per copy) without changing a loss; under mpirun on 2 ranks lane_arbiter=on gives the losses
# of lane_arbiter=off with the node arbiter's per-link stats, and `bench offload` prints the
# off-vs-on table.
#   lane_cli.sh HOTPATH_BINARY SOURCE_DIR
set -uo pipefail
hp=$1
src=$2
cfg=$src/examples/configs/tiny-moe.ini
work=$(mktemp -d "${TMPDIR:-/tmp}/hp_lane_cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
fails=0
passes=0
pass() { passes=$((passes + 1)); echo "ok: $*"; }
fail() { fails=$((fails + 1)); echo "FAIL: $*"; }

# expect_config_error NAME PATTERN ARGS...: hotpath ARGS must exit 2 and print PATTERN.
expect_config_error() {
  local name=$1 pattern=$2
  shift 2
  local out rc
  out=$("$hp" "$@" 2>&1)
  rc=$?
  if [ $rc -ne 2 ]; then
    fail "$name: exit $rc, want 2: $(tail -2 <<<"$out")"
  elif ! grep -qE -- "$pattern" <<<"$out"; then
    fail "$name: message lacks /$pattern/: $out"
  else
    pass "$name (exit 2)"
  fi
}

small="--config $cfg --batch_tokens=1024 --seq_len=256"
expect_config_error "lane_arbiter=maybe" "'lane_arbiter'.*on or off" train $small --lane_arbiter=maybe --dry-run
expect_config_error "lane_chunk_mib=0" "'lane_chunk_mib'.*\[1, 4096\]" train $small --lane_chunk_mib=0 --dry-run
expect_config_error "lane_inflight=0" "'lane_inflight'.*\[1, 64\]" train $small --lane_inflight=0 --dry-run
expect_config_error "pcie_groups=a:b" "'pcie_groups'.*0,1;2,3" train $small --pcie_groups=a:b --dry-run
# Rank numbers are checked against the node when the arbiter is built (offload != none).
expect_config_error "pcie_groups names a rank outside the node" "'pcie_groups'.*rank 1, outside the node" \
  train $small --offload=double --lane_arbiter=on --pcie_groups="0,1" --steps=1

# One rank: block inputs of 2560 tokens x 128 f32 = 1.25 MiB, chunks of 1 MiB: 2 per copy.
one="--config $cfg --batch_tokens=2560 --seq_len=256 --steps=2 --lane_chunk_mib=1"
"$hp" train $one --metrics_path="$work/plain.jsonl" --checkpoint_activations=true >"$work/plain.log" 2>&1 ||
  fail "offload=none run: $(tail -3 "$work/plain.log")"
"$hp" train $one --offload=double --metrics_path="$work/one.jsonl" >"$work/one.log" 2>&1 ||
  fail "offload=double run: $(tail -3 "$work/one.log")"
field() { grep -o "\"$2\":[0-9.e+-]*" "$1" | head -1 | cut -d: -f2; }
last() { tail -1 "$1" >"$1.last" && echo "$1.last"; }
if [ -s "$work/one.jsonl" ]; then
  l=$(last "$work/one.jsonl")
  ob=$(field "$l" offload_bytes) oc=$(field "$l" offload_chunks)
  rb=$(field "$l" reload_bytes) rc=$(field "$l" reload_chunks)
  blocks=3  # n_layers - 1: the last block's input stays on the device
  per=$(( (ob / blocks + 1048575) / 1048576 ))
  if [ -n "$ob" ] && [ "$ob" -eq $((blocks * 2560 * 128 * 4)) ] && [ "$per" -eq 2 ] &&
     [ "$oc" -eq $((blocks * per)) ] && [ "$rc" -eq $((blocks * per)) ] && [ "$rb" -eq "$ob" ]; then
    pass "JSONL lane stats: $oc offload + $rc reload chunks of 1 MiB for $blocks blocks of $((ob / blocks)) bytes"
  else
    fail "JSONL lane stats: $(cat "$l")"
  fi
  grep -q '"lane":{"arbiter":"local"' "$l" && grep -q '"reload_max_wait_s"' "$l" && grep -q '"gbps"' "$l" &&
    pass "JSONL lane keys" || fail "JSONL lane keys: $(cat "$l")"
  grep -q '"offload":0' "$l" && pass "0 offload syncs" || fail "offload syncs: $(cat "$l")"
  grep -q 'lane_mib=r.*lane_wait_ms=.*lane_gbps=' "$work/one.log" && pass "step line lane fields" ||
    fail "step line: $(grep 'step=' "$work/one.log" | tail -1)"
fi
la=$(grep -o '"loss":[^,]*' "$work/plain.jsonl")
lb=$(grep -o '"loss":[^,]*' "$work/one.jsonl")
[ -n "$la" ] && [ "$la" = "$lb" ] && pass "offload through the arbiter: same losses as offload=none" ||
  fail "losses differ: $la vs $lb"

# Two ranks of one node, both offloading: on vs off, same losses; node stats with Jain's index.
if command -v mpirun >/dev/null; then
  mpi="mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS -np 2"
  two="--config $cfg --batch_tokens=2048 --seq_len=256 --steps=2 --offload=double --lane_chunk_mib=1 --sim_link_gbps=2"
  timeout 300 $mpi "$hp" train $two --lane_arbiter=off --metrics_path="$work/off.jsonl" >"$work/off.log" 2>&1 ||
    fail "2 ranks lane_arbiter=off: $(tail -3 "$work/off.log")"
  timeout 300 $mpi "$hp" train $two --lane_arbiter=on --pcie_groups=auto --metrics_path="$work/on.jsonl" >"$work/on.log" 2>&1 ||
    fail "2 ranks lane_arbiter=on: $(tail -3 "$work/on.log")"
  # pcie_groups=auto without a PCI device to locate: both ranks on one link.
  grep -q 'link ranks=0,1' "$work/on.log" && pass "2 ranks: pcie_groups=auto puts unknown links together" ||
    fail "2 ranks pcie_groups=auto: $(grep 'offload copies' "$work/on.log")"
  la=$(grep -o '"loss":[^,]*' "$work/off.jsonl" 2>/dev/null)
  lb=$(grep -o '"loss":[^,]*' "$work/on.jsonl" 2>/dev/null)
  [ -n "$la" ] && [ "$la" = "$lb" ] && pass "2 ranks: lane_arbiter=on gives the losses of off" ||
    fail "2 ranks: losses differ: $la vs $lb"
  if [ -s "$work/on.jsonl" ]; then
    l=$(last "$work/on.jsonl")
    grep -q '"arbiter":"node"' "$l" && grep -q '"link_ranks":\[0,1\]' "$l" && grep -q '"jain":' "$l" &&
      grep -q '"offload":0' "$l" && pass "2 ranks: node arbiter stats, 0 offload syncs" ||
      fail "2 ranks JSONL: $(cat "$l")"
    oc=$(field "$l" offload_chunks) ob=$(field "$l" offload_bytes)
    [ -n "$oc" ] && [ "$oc" -eq $(( 3 * ((ob / 3 + 1048575) / 1048576) )) ] &&
      pass "2 ranks: $oc offload chunks for $ob bytes" || fail "2 ranks chunks: $(cat "$l")"
    grep -q 'jain=' "$work/on.log" && pass "2 ranks: step line has jain=" ||
      fail "2 ranks step line: $(grep 'step=' "$work/on.log" | tail -1)"
  fi
  timeout 300 $mpi "$hp" bench offload $two --bench_warmup=1 --bench_steps=3 \
    --bench_json="$work/bench.json" >"$work/bench.log" 2>&1 ||
    fail "2 ranks bench offload: $(tail -5 "$work/bench.log")"
  if grep -q 'lane arbiter off vs on' "$work/bench.log" &&
     grep -qE '^on +node +1 ' "$work/bench.log" && grep -qE '^off +local +1 ' "$work/bench.log" &&
     grep -q 'GB/s max/min' "$work/bench.log" && grep -q '"lane":\[' "$work/bench.json"; then
    pass "2 ranks bench offload: off-vs-on table"
    sed -n '/lane arbiter off vs on/,$p' "$work/bench.log" | sed 's/^/    /'
  else
    fail "2 ranks bench offload table: $(tail -12 "$work/bench.log")"
  fi
else
  fail "mpirun not found"
fi

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
