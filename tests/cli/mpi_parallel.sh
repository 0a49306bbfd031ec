#!/usr/bin/env bash
# Multi-rank tests of parallel/.
#
# 1. The MultiRank.* / MultiGroups.* cases of parallel_tests on 2 and 4 ranks: under mpirun (MPI
#    communicator), and as plain processes over TCP, launched the way a non-MPI launcher would
#    (RANK/WORLD_SIZE/LOCAL_RANK, or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) with a file: or tcp:
#    rendezvous. Every rank must pass every case, none skipped.
# 2. Injected faults (FaultInjection.*, selected by HP_TEST_FAULT), under mpirun and over TCP:
#    a rank that arrives late (the others' all_reduce must time out after 2 s naming the rank and
#    the collective), a rank that throws, a rank that dies. The job must end with a non-zero
#    status, well before the safety timeout around it.
#
# Usage: mpi_parallel.sh <path-to-hotpath> [source-dir]. parallel_tests is taken from the
# directory of the hotpath executable (both are built into <build>/bin).
set -u

if [[ $# -lt 1 ]]; then
  echo "usage: $0 <path-to-hotpath> [source-dir]" >&2
  exit 2
fi
bin_dir=$(cd "$(dirname "$1")" && pwd)
tests="$bin_dir/parallel_tests"
if [[ ! -x $tests ]]; then
  echo "mpi_parallel: $tests not found; build the parallel_tests target" >&2
  exit 1
fi

mpirun_args=(--oversubscribe --bind-to none)
if [[ $(id -u) -eq 0 ]]; then mpirun_args+=(--allow-run-as-root); fi

# Launch variables of an outer launcher must not leak into the processes started here.
clean_env=(env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK
           -u OMPI_COMM_WORLD_LOCAL_SIZE -u PMIX_RANK -u RANK -u WORLD_SIZE -u LOCAL_RANK
           -u LOCAL_WORLD_SIZE -u SLURM_PROCID -u SLURM_NTASKS -u SLURM_NPROCS -u SLURM_LOCALID
           -u SLURM_NODEID -u SLURM_TASKS_PER_NODE -u HP_TEST_BOOTSTRAP -u HP_TEST_FAULT)

work=$(mktemp -d "${TMPDIR:-/tmp}/hp_mpi_parallel.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
script_start=$SECONDS

ok() { echo "ok    $*"; }
fail() {
  echo "FAIL  $*"
  failures=$((failures + 1))
}
show() {
  local f
  for f in "$@"; do
    echo "----- $f (last 30 lines)"
    tail -n 30 "$f"
  done
}

# Each rank's gtest summary must say PASSED, with nothing failed or skipped.
all_passed() {
  local log n=$1
  shift
  local passed
  passed=$(cat "$@" | grep -c '^\[  PASSED  \]')
  [[ $passed -eq $n ]] || return 1
  ! cat "$@" | grep -q -E '^\[  (FAILED|SKIPPED) \]'
}

# ---- 1. collectives and groups ---------------------------------------------------------------

run_mpi() {  # <ranks>
  local n=$1 log="$work/mpi.$1.log" start=$SECONDS rc
  timeout 300 mpirun "${mpirun_args[@]}" -np "$n" "$tests" --gtest_color=no \
    --gtest_filter='Multi*' >"$log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]] && all_passed "$n" "$log"; then
    ok "mpirun -np $n: Multi* passed on every rank ($((SECONDS - start)) s)"
  else
    fail "mpirun -np $n: exit $rc"
    show "$log"
  fi
}

# Starts <ranks> processes of parallel_tests; leaves their exit statuses in rcs[] and logs in
# $work/<name>.<rank>.log.
start_tcp() {  # <name> <ranks> <env|slurm> <bootstrap> <gtest filter> [fault]
  local name=$1 n=$2 how=$3 boot=$4 filter=$5 fault=${6:-} r pids=()
  for ((r = 0; r < n; r++)); do
    local vars=()
    if [[ $how == env ]]; then
      vars=(RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r)
    else
      vars=(SLURM_PROCID=$r SLURM_NTASKS=$n SLURM_LOCALID=$r SLURM_NODEID=0 SLURM_TASKS_PER_NODE=$n)
    fi
    if [[ -n $fault ]]; then vars+=(HP_TEST_FAULT=$fault); fi
    "${clean_env[@]}" "${vars[@]}" HP_TEST_BOOTSTRAP="$boot" timeout 120 "$tests" \
      --gtest_color=no --gtest_filter="$filter" >"$work/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  rcs=()
  for r in "${pids[@]}"; do
    wait "$r"
    rcs+=($?)
  done
}

run_tcp() {  # <ranks> <env|slurm> <bootstrap>
  local n=$1 how=$2 boot=$3 name="tcp.$2.$1" start=$SECONDS
  start_tcp "$name" "$n" "$how" "$boot" 'Multi*'
  local logs=("$work/$name".*.log)
  if [[ ${rcs[*]} == "$(printf '0 %.0s' $(seq "$n") | sed 's/ $//')" ]] && all_passed "$n" "${logs[@]}"
  then
    ok "TCP $how launch, $n ranks, $boot: Multi* passed on every rank ($((SECONDS - start)) s)"
  else
    fail "TCP $how launch, $n ranks, $boot: exit statuses ${rcs[*]}"
    show "${logs[@]}"
  fi
}

run_mpi 2
run_mpi 4
run_tcp 2 env "file:$work/rdv.env.2"
run_tcp 4 env "file:$work/rdv.env.4"
run_tcp 2 slurm "file:$work/rdv.slurm.2"
run_tcp 4 slurm "file:$work/rdv.slurm.4"
run_tcp 3 env "tcp:127.0.0.1:$((20000 + RANDOM % 20000))"

# ---- 2. faults ---------------------------------------------------------------------------------

# The job must fail (non-zero), not hang (the safety timeout gives 124), and not take long.
fault_mpi() {  # <fault> <grep -E pattern expected in the output>
  local fault=$1 pattern=$2 log="$work/fault.mpi.$1.log" start=$SECONDS rc
  HP_TEST_FAULT=$fault timeout 60 mpirun "${mpirun_args[@]}" -x HP_TEST_FAULT -np 4 "$tests" \
    --gtest_color=no --gtest_filter='FaultInjection.*' >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - start))
  if [[ $rc -eq 124 ]]; then
    fail "mpirun fault '$fault': the job hung (killed after 60 s)"
    show "$log"
  elif [[ $rc -eq 0 ]]; then
    fail "mpirun fault '$fault': the job exited 0"
    show "$log"
  elif ! grep -q -E "$pattern" "$log"; then
    fail "mpirun fault '$fault': exit $rc but no line matches: $pattern"
    show "$log"
  elif [[ $took -gt 30 ]]; then
    fail "mpirun fault '$fault': took $took s"
  else
    ok "mpirun fault '$fault': exit $rc after $took s, reported: $(grep -o -m1 -E "$pattern" "$log")"
  fi
}

fault_tcp() {  # <fault> <pattern>
  local fault=$1 pattern=$2 name="fault.tcp.$1" start=$SECONDS r
  start_tcp "$name" 4 env "file:$work/rdv.fault.$fault" 'FaultInjection.*' "$fault"
  local took=$((SECONDS - start)) logs=("$work/$name".*.log) bad=""
  for r in "${rcs[@]}"; do
    if [[ $r -eq 0 || $r -eq 124 ]]; then bad="$bad $r"; fi
  done
  if [[ -n $bad ]]; then
    fail "TCP fault '$fault': exit statuses ${rcs[*]} (0: kept going, 124: hung)"
    show "${logs[@]}"
  elif ! cat "${logs[@]}" | grep -q -E "$pattern"; then
    fail "TCP fault '$fault': no line matches: $pattern"
    show "${logs[@]}"
  elif [[ $took -gt 30 ]]; then
    fail "TCP fault '$fault': took $took s"
  else
    ok "TCP fault '$fault': exit statuses ${rcs[*]} after $took s, reported:" \
      "$(cat "${logs[@]}" | grep -o -m1 -E "$pattern")"
  fi
}

fault_mpi timeout "rank [0-2]: all_reduce on 'world' timed out after 2 s"
fault_mpi throw "rank 1 caught: injected failure on rank 1"
fault_mpi exit "exited with non-zero status"  # mpirun reports it and ends the job
fault_tcp timeout "rank [0-2]: all_reduce on 'world' timed out after 2 s waiting for rank 3"
fault_tcp throw "rank [023]: barrier on 'world': rank 1 aborted: injected failure on rank 1"
fault_tcp exit "rank [023]: barrier on 'world': (rank 1 closed the connection|lost the connection to rank 1)"

echo "mpi_parallel: $failures failure(s) in $((SECONDS - script_start)) s"
[[ $failures -eq 0 ]]
