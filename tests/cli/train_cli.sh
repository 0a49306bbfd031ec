#!/usr/bin/env bash
# Whole-program checks of `hotpath train`: dry-run parameter counts of the full shapes, that
# bad configs and bad data fail early with a message naming the key or file, and that two
# identical runs log bitwise-identical losses with 0 metadata syncs.
#   train_cli.sh HOTPATH_BINARY SOURCE_DIR
set -uo pipefail
hp=$1
src=$2
cfg=$src/examples/configs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
passes=0
pass() { passes=$((passes + 1)); echo "ok: $*"; }
fail() { fails=$((fails + 1)); echo "FAIL: $*"; }

# expect_error NAME PATTERN CMD...: CMD must exit non-zero and print PATTERN (grep -E).
expect_error() {
  local name=$1 pattern=$2
  shift 2
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ $rc -eq 0 ]; then
    fail "$name: exited 0"
  elif ! grep -qE -- "$pattern" <<<"$out"; then
    fail "$name: message lacks /$pattern/: $out"
  else
    pass "$name (exit $rc)"
  fi
}

# within PCT ACTUAL EXPECTED
within() { awk -v p="$1" -v a="$2" -v e="$3" 'BEGIN { d = a - e; if (d < 0) d = -d; exit !(d <= p / 100 * e) }'; }

check_counts() {
  local ini=$1 total=$2 active=$3
  local line
  line=$("$hp" train --config "$cfg/$ini" --dry-run 2>&1)
  local t a
  t=$(sed -n 's/^params: total=\([0-9]*\) active=\([0-9]*\)$/\1/p' <<<"$line")
  a=$(sed -n 's/^params: total=\([0-9]*\) active=\([0-9]*\)$/\2/p' <<<"$line")
  if [ -z "$t" ]; then fail "$ini dry-run printed: $line"; return; fi
  within 2 "$t" "$total" && within 2 "$a" "$active" && pass "$ini: $line" ||
    fail "$ini: $line, expected total~$total active~$active (2%)"
}
check_counts gptoss-20b.ini 20.9e9 3.6e9
check_counts gptoss-120b.ini 116.8e9 5.1e9
for ini in llama-3.2-1b.ini qwen3-0.6b.ini tiny-moe.ini tiny-dense.ini; do
  "$hp" train --config "$cfg/$ini" --dry-run >/dev/null 2>&1 && pass "$ini dry-run" || fail "$ini dry-run"
done

# Bad configs: each names the key (or file) and what is valid.
expect_error "missing config file" "no-such.ini" "$hp" train --config "$work/no-such.ini"
printf 'd_model = 64\nbogus_key = 3\n' >"$work/bad.ini"
expect_error "unknown key in file" "bogus_key" "$hp" train --config "$work/bad.ini"
expect_error "unknown flag" "no_such_flag" "$hp" train --config "$cfg/tiny-moe.ini" --no_such_flag=1
expect_error "non-numeric value" "d_model" "$hp" train --config "$cfg/tiny-moe.ini" --d_model=big
expect_error "heads do not divide" "n_kv_heads" "$hp" train --config "$cfg/tiny-moe.ini" --n_kv_heads=3 --dry-run
expect_error "top_k > n_experts" "top_k" "$hp" train --config "$cfg/tiny-moe.ini" --top_k=9 --dry-run
expect_error "batch not multiple of seq_len" "batch_tokens" "$hp" train --config "$cfg/tiny-moe.ini" --batch_tokens=1000 --dry-run
expect_error "bad enum" "routing" "$hp" train --config "$cfg/tiny-moe.ini" --routing=magic --dry-run
expect_error "bad device" "device" "$hp" train --config "$cfg/tiny-moe.ini" --device=tpu --dry-run
expect_error "unknown command" "unknown command" "$hp" frobnicate

# Bad data files.
small="--config $cfg/tiny-moe.ini --batch_tokens=512 --seq_len=64"
expect_error "missing data file" "missing.bin" "$hp" train $small --data="$work/missing.bin"
"$hp" data synth --out "$work/ok.bin" --docs 200 --vocab_size 16 --seed 3 >/dev/null 2>&1 ||
  fail "data synth .bin"
"$hp" data synth --out "$work/ok.h5" --docs 200 --vocab_size 16 --seed 3 >/dev/null 2>&1 ||
  fail "data synth .h5"
"$hp" data synth --out "$work/wide.bin" --docs 50 --vocab_size 64 --seed 3 >/dev/null 2>&1 ||
  fail "data synth wide .bin"
head -c 2000 "$work/ok.bin" >"$work/truncated.bin"
expect_error "truncated shard" "truncated.bin.*(truncated|header)" "$hp" train $small --data="$work/truncated.bin"
cp "$work/ok.bin" "$work/badmagic.bin"
printf '\x01\x02\x03\x04' | dd of="$work/badmagic.bin" bs=1 seek=0 conv=notrunc status=none
expect_error "bad magic" "magic.*badmagic.bin" "$hp" train $small --data="$work/badmagic.bin"
expect_error "token id >= vocab" "offset.*wide.bin.*vocab_size" "$hp" train $small --data="$work/wide.bin" --eot_token=15
printf 'not hdf5' >"$work/garbage.h5"
expect_error "not an HDF5 file" "garbage.h5" "$hp" train $small --data="$work/garbage.h5"
expect_error "unknown extension" "tokens.txt" "$hp" train $small --data="$work/tokens.txt"

# Both file formats train.
for f in ok.bin ok.h5; do
  "$hp" train $small --steps=2 --data="$work/$f" >"$work/$f.log" 2>&1 && grep -q "step=2 " "$work/$f.log" &&
    pass "trains from $f" || fail "train from $f: $(tail -3 "$work/$f.log")"
done

# Determinism and the metadata budget: two identical runs, bitwise-identical losses.
run() { "$hp" train --config "$cfg/tiny-moe.ini" --steps=4 --batch_tokens=1024 --metrics_path="$1" >/dev/null 2>&1; }
run "$work/a.jsonl" && run "$work/b.jsonl" || fail "tiny-moe run failed"
la=$(grep -o '"loss":[^,]*' "$work/a.jsonl")
lb=$(grep -o '"loss":[^,]*' "$work/b.jsonl")
[ -n "$la" ] && [ "$la" = "$lb" ] && [ "$(wc -l <"$work/a.jsonl")" -eq 4 ] &&
  pass "identical runs, identical losses" || fail "losses differ: $la vs $lb"
grep -q '"metadata":0' "$work/a.jsonl" && ! grep -q '"metadata":[1-9]' "$work/a.jsonl" &&
  pass "0 metadata syncs per step" || fail "metadata syncs: $(head -1 "$work/a.jsonl")"
grep -q '"routing":4,' "$work/a.jsonl" && pass "1 routing sync per MoE layer" ||
  fail "routing syncs: $(head -1 "$work/a.jsonl")"

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
