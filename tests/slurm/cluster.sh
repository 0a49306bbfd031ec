#!/usr/bin/env bash
# A single-node Slurm cluster for the `slurm` tests: munged, slurmctld and slurmd of Debian 12
# (packages munge, slurmctld, slurmd, slurm-client), run as root from a private directory, with
# their own munge key, sockets, ports and state, so nothing of a system-wide Slurm is touched.
#
#   source tests/slurm/cluster.sh
#   hp_slurm_start DIR    # prints why and returns 1 where it cannot; exports SLURM_CONF
#   hp_slurm_stop DIR     # stops the daemons it started, by pid
#
# Or as a command: tests/slurm/cluster.sh start|stop DIR. The `slurm` tests find the cluster
# through DIR/slurm.conf (SLURM_CONF, or HP_SLURM_DIR=DIR) and skip, saying why, without one.
# Every wait is bounded, so a daemon that does not come up cannot hang the caller.

hp_slurm_log() { echo "[slurm] $*" >&2; }

# hp_slurm_install: the packages, where missing (needs root; apt-get).
hp_slurm_install() {
  local missing=() p
  for p in munge slurmctld slurmd slurm-client; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || { hp_slurm_log "no apt-get to install ${missing[*]}"; return 1; }
  hp_slurm_log "installing: ${missing[*]}"
  timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { timeout 300 apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null 2>&1; } ||
    { hp_slurm_log "could not install ${missing[*]}"; return 1; }
}

# A TCP port nobody listens on now.
hp_slurm_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# hp_slurm_wait SECONDS COMMAND...: COMMAND until it succeeds, at most SECONDS.
hp_slurm_wait() {
  local limit=$1 t=0
  shift
  while ! "$@" >/dev/null 2>&1; do
    t=$((t + 1))
    [ $t -ge $((limit * 2)) ] && return 1
    sleep 0.5
  done
}

hp_slurm_start() {
  local d=$1
  if [ "$(id -u)" -ne 0 ]; then hp_slurm_log "not root: no Slurm cluster"; return 1; fi
  hp_slurm_install || return 1
  local p
  for p in munged slurmctld slurmd srun sbatch scontrol; do
    command -v "$p" >/dev/null || [ -x "/usr/sbin/$p" ] ||
      { hp_slurm_log "$p not found: no Slurm cluster"; return 1; }
  done
  hp_slurm_stop "$d" 2>/dev/null
  rm -rf "$d" && mkdir -p "$d/state" "$d/spool" "$d/munge" "$d/log" || return 1
  chmod 700 "$d/munge"
  local host cpus mem ctl_port d_port
  host=$(hostname -s)
  cpus=$(nproc)
  # Tests start up to 4 tasks on small machines: the node claims at least 4 CPUs
  # (SlurmdParameters=config_overrides lets slurmd accept more than it finds).
  [ "$cpus" -lt 4 ] && cpus=4
  mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
  ctl_port=$(hp_slurm_free_port) && d_port=$(hp_slurm_free_port) || return 1

  dd if=/dev/urandom of="$d/munge/munge.key" bs=1024 count=1 2>/dev/null && chmod 400 "$d/munge/munge.key"
  timeout 30 /usr/sbin/munged --force --key-file="$d/munge/munge.key" --socket="$d/munge/munge.socket" \
    --pid-file="$d/munge/munged.pid" --log-file="$d/log/munged.log" --seed-file="$d/munge/seed" \
    2>>"$d/log/munged.log" || { hp_slurm_log "munged did not start ($d/log/munged.log)"; return 1; }
  hp_slurm_wait 10 test -S "$d/munge/munge.socket" ||
    { hp_slurm_log "munged did not open its socket"; hp_slurm_stop "$d"; return 1; }

  cat >"$d/slurm.conf" <<EOF
ClusterName=hotpath
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctl_port}
SlurmdPort=${d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
RequeueExit=75
JobRequeue=1
SchedulerParameters=sched_interval=5
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.log
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=hp Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF="$d/slurm.conf"
  timeout 30 /usr/sbin/slurmctld -f "$d/slurm.conf" -i 2>>"$d/log/slurmctld.log" ||
    { hp_slurm_log "slurmctld did not start ($d/log/slurmctld.log)"; hp_slurm_stop "$d"; return 1; }
  timeout 30 /usr/sbin/slurmd -f "$d/slurm.conf" 2>>"$d/log/slurmd.log" ||
    { hp_slurm_log "slurmd did not start ($d/log/slurmd.log)"; hp_slurm_stop "$d"; return 1; }
  if ! hp_slurm_wait 30 bash -c "timeout 5 sinfo -h -o %T -n $host | grep -qE '^(idle|mixed|allocated)'"; then
    hp_slurm_log "the node did not come up within 30 s: $(timeout 5 sinfo -h -N 2>&1 | head -1)"
    tail -n 5 "$d/log/slurmctld.log" "$d/log/slurmd.log" >&2 2>/dev/null
    hp_slurm_stop "$d"
    return 1
  fi
  hp_slurm_log "cluster up: node $host, $cpus CPUs, SLURM_CONF=$d/slurm.conf"
}

hp_slurm_stop() {
  local d=$1 f pid
  [ -f "$d/slurm.conf" ] && SLURM_CONF="$d/slurm.conf" timeout 10 scancel --quiet -u root >/dev/null 2>&1
  for f in "$d/slurmd.pid" "$d/slurmctld.pid" "$d/munge/munged.pid"; do
    [ -f "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null)
    [ -n "$pid" ] && kill "$pid" 2>/dev/null
    local t=0
    while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $t -lt 20 ]; do sleep 0.5; t=$((t + 1)); done
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    rm -f "$f"
  done
  return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    start) hp_slurm_start "${2:?usage: $0 start|stop DIR}" ;;
    stop) hp_slurm_stop "${2:?usage: $0 start|stop DIR}" ;;
    *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
  esac
fi
