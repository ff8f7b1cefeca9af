#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests marked `slurm` (and for trying
# `--executor slurm` locally): munged, slurmctld and slurmd as plain daemons (no systemd), one
# partition `local` over this machine's cores, no cgroups (proctrack/linuxproc), no accounting.
#
#   scripts/local-slurm.sh start    install slurm-wlm + munge when missing (apt-get, as root), write
#                                   /etc/slurm/slurm.conf, start the daemons, wait for the node
#   scripts/local-slurm.sh stop     stop the daemons this script started (by their pid files)
#   scripts/local-slurm.sh status   sinfo (exit 1 when the cluster does not answer)
#
# Idempotent: `start` on a running cluster only checks it. Needs root (Debian/Ubuntu). Fails loudly
# (non-zero exit, message on stderr) when anything cannot be installed or started.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by dselectk scripts/local-slurm.sh"
STATE=${DSELECTK_SLURM_STATE:-/var/spool/dselectk-slurm}
LOGS=/var/log/dselectk-slurm
RUN=/run/dselectk-slurm
PARTITION=local

die() { echo "local-slurm: error: $*" >&2; exit 1; }
say() { echo "local-slurm: $*"; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sinfo >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurm is not installed and apt-get is not available"
    say "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || { sleep 5; apt-get update -qq; } || die "apt-get update failed (twice)"
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
}

write_config() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it"
    fi
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    # half of the memory: slurmd drains a node that has less than RealMemory
    mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 / 2}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$LOGS" "$RUN"
    cat >"$CONF" <<CONF
$MARK
ClusterName=dselectk-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then mungekey --create --force
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge)"
    for _ in $(seq 20); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.5
    done
    die "munged does not answer"
}

node_state() { sinfo -h -N -p "$PARTITION" -o "%t" 2>/dev/null | head -1; }

start() {
    need_root
    install_packages
    write_config
    start_munge
    alive "$RUN/slurmctld.pid" || slurmctld || die "slurmctld did not start (see $LOGS/slurmctld.log)"
    alive "$RUN/slurmd.pid" || slurmd || die "slurmd did not start (see $LOGS/slurmd.log)"
    local state=""
    for _ in $(seq 60); do
        state=$(node_state || true)
        case "$state" in
            idle*|mix*|alloc*) sinfo; return ;;
            drain*|down*) scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    tail -n 20 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 || true
    die "the node did not come up (state: ${state:-no answer})"
}

stop_pid() {  # name pidfile
    if alive "$2"; then
        local pid; pid=$(cat "$2")
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        say "stopped $1 ($pid)"
    fi
    rm -f "$2"
}

stop() {
    need_root
    stop_pid slurmd "$RUN/slurmd.pid"
    stop_pid slurmctld "$RUN/slurmctld.pid"
    stop_pid munged /run/munge/munged.pid
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo || exit 1 ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
