#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests of `hybridflow slurm --submit`.
#
#   bash scripts/slurm_single_node.sh install  # apt-get install slurm-wlm munge (root; no-op if installed)
#   bash scripts/slurm_single_node.sh start    # write slurm.conf, start munged, slurmctld, slurmd
#   bash scripts/slurm_single_node.sh status   # exit 0 when the node accepts jobs
#   bash scripts/slurm_single_node.sh stop     # stop the daemons this script started
#
# Needs root and Debian's packages: apt-get install -y slurm-wlm munge. Everything lives under
# $HYBRIDFLOW_SLURM_DIR (default /tmp/hybridflow-slurm): the config, spool, state and logs. The
# system's /etc/slurm is never touched, so Slurm commands must be pointed at this cluster with
#   export SLURM_CONF=$HYBRIDFLOW_SLURM_DIR/slurm.conf
# which `start` prints as its last line. No cgroups or systemd: processes are tracked through
# /proc (proctrack/linuxproc), tasks are not confined (task/none), and finished jobs are recorded
# in a text file (jobcomp/filetxt) that `sacct --completion` reads: no slurmdbd, no database.
# `start` is idempotent: a cluster that already answers is left running.
set -euo pipefail

dir="${HYBRIDFLOW_SLURM_DIR:-/tmp/hybridflow-slurm}"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

die() { printf 'slurm_single_node.sh: error: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed; run: apt-get install -y slurm-wlm munge"; }

write_conf() {
  local host cpus memory
  host="$(hostname -s)"
  # slurmd -C describes this machine as Slurm sees it: CPUs and memory in MB.
  cpus="$(slurmd -C | sed -n 's/.* CPUs=\([0-9]*\).*/\1/p')"
  memory="$(slurmd -C | sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p')"
  mkdir -p "$dir/spool/slurmd" "$dir/state" "$dir/log"
  cat >"$conf.tmp" <<EOF
# Written by scripts/slurm_single_node.sh: a one-node test cluster on $host.
ClusterName=hybridflow
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
# requeued jobs start again at once; signals ahead of the time limit reach batch scripts
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$conf.tmp" "$conf"
}

# Quiet and unattended: no prompts (CI has no stdin), no recommended extras, and apt's chatter
# kept in a log that is shown only on failure. Nothing is done when both packages are installed.
install() {
  local packages=(slurm-wlm munge) log
  if (($(dpkg-query -W -f='${db:Status-Status}\n' "${packages[@]}" 2>/dev/null | grep -cx installed) \
        < ${#packages[@]})); then
    ((EUID == 0)) || die "installing ${packages[*]} needs root"
    log="$(mktemp)"
    # another apt on the machine (unattended upgrades, a colleague) is waited for, not failed on
    local wait=(-o DPkg::Lock::Timeout=300)
    if ! { apt-get "${wait[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${wait[@]}" install \
             -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 "${packages[@]}"; } >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      die "apt-get install ${packages[*]} failed (output above)"
    fi
    rm -f "$log"
  fi
  need slurmctld; need slurmd; need munged; need sbatch
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [[ -f /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge)"
  runuser -u munge -- munged
  munge -n </dev/null | unmunge >/dev/null || die "munged started but a credential does not round-trip"
  # recorded beside the cluster's own pid files, so `stop` ends this munged and never one it found
  cp /run/munge/munged.pid "$dir/munged.pid"
}

cluster_ready() {
  [[ -f "$conf" ]] && sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'
}

start() {
  need slurmctld; need slurmd; need munged; need sbatch
  ((EUID == 0)) || die "needs root (slurmd runs jobs as any user)"
  if cluster_ready; then
    echo "SLURM_CONF=$conf"
    return
  fi
  write_conf
  start_munge
  pgrep -F "$dir/slurmctld.pid" >/dev/null 2>&1 || slurmctld -f "$conf"
  pgrep -F "$dir/slurmd.pid" >/dev/null 2>&1 || slurmd -f "$conf"
  for _ in $(seq 60); do
    cluster_ready && { echo "SLURM_CONF=$conf"; return; }
    sleep 0.5
  done
  tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
  die "the node did not become idle within 30 s (logs above, under $dir/log)"
}

stop() {
  local name
  for name in slurmd slurmctld munged; do
    if [[ -f "$dir/$name.pid" ]] && pid="$(cat "$dir/$name.pid")" && kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) cluster_ready ;;
  *) sed -n '2,8s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
