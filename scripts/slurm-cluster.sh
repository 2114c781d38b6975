#!/usr/bin/env bash
# A private one-node SLURM cluster on 127.0.0.1 for the slurm-marked tests and for trying the
# SLURM launcher without a real cluster.
#
#   bash scripts/slurm-cluster.sh install        # Debian's slurmctld slurmd slurm-client munge (idempotent, ~0.1 s when present)
#   eval "$(bash scripts/slurm-cluster.sh start)"  # start munged, slurmctld -D, slurmd -D; prints `export SLURM_CONF=...`
#   bash scripts/slurm-cluster.sh status         # sinfo against the private cluster
#   bash scripts/slurm-cluster.sh stop           # kill the daemons by the PIDs that `start` recorded
#
# Everything lives in one private folder ($BUFREUSE_SLURM_DIR, default /tmp/bufreuse-slurm-$UID):
# slurm.conf, a fresh munge key and socket, state, spool, logs, the jobcomp file and `pids`.
# Nothing under /etc is used or changed, so it runs next to (not instead of) a site's SLURM.
# `start` prints only the environment lines on stdout; progress and errors go to stderr.
# Knobs: BUFREUSE_SLURM_CPUS (CPUs the node advertises, default max(nproc, 8)),
# BUFREUSE_SLURM_PORT (slurmctld port, default 16817; slurmd uses +1).
set -euo pipefail

DIR="${BUFREUSE_SLURM_DIR:-/tmp/bufreuse-slurm-$(id -u)}"
PORT="${BUFREUSE_SLURM_PORT:-16817}"
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "slurm-cluster: $*" >&2; }
die() { log "$*"; exit 1; }

have_all() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo -n "$@"
    else die "need root (or passwordless sudo) to run: $*"
    fi
}

cmd_install() {
    PATH="$PATH:/usr/sbin:/sbin"
    if have_all; then log "already installed ($(slurmd -V 2>/dev/null))"; return 0; fi
    command -v apt-get >/dev/null || die "apt-get not found: install ${PACKAGES[*]} with your package manager"
    export DEBIAN_FRONTEND=noninteractive
    if ! as_root apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2; then
        as_root apt-get update -q >&2
        as_root apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2
    fi
    have_all || die "installed ${PACKAGES[*]} but slurmctld/slurmd/sbatch/munged are still not on PATH"
    log "installed ($(slurmd -V 2>/dev/null))"
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

cmd_stop() {
    local pids="$DIR/pids"
    [ -f "$pids" ] || { log "not running (no $pids)"; return 0; }
    local name pid
    # slurmd first, then the controller, then munge: each stops while what it talks to still runs.
    for name in slurmd slurmctld munged; do
        pid="$(awk -v n="$name" '$1 == n {print $2}' "$pids")"
        alive "$pid" && kill "$pid" 2>/dev/null || true
    done
    for _ in $(seq 50); do
        local any=0
        while read -r name pid; do alive "$pid" && any=1; done <"$pids"
        [ "$any" = 0 ] && break
        sleep 0.1
    done
    while read -r name pid; do
        if alive "$pid"; then log "$name ($pid) ignored SIGTERM; sending SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
    done <"$pids"
    rm -f "$pids"
    log "stopped"
}

write_conf() {
    local host cpus nproc_
    host="$(hostname -s)"
    nproc_="$(nproc)"
    cpus="${BUFREUSE_SLURM_CPUS:-$((nproc_ > 8 ? nproc_ : 8))}"
    local user
    user="$(id -un)"
    cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm-cluster.sh: a private one-node cluster (no cgroups, no accounting daemon).
ClusterName=bufreuse
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerParameters=sched_interval=1
ReturnToService=2
MpiDefault=none
KillWait=2
MinJobAge=600
MessageTimeout=10
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=short Nodes=ALL Default=NO MaxTime=INFINITE State=UP
EOF
}

cmd_start() {
    PATH="$PATH:/usr/sbin:/sbin"
    have_all || die "SLURM is not installed: run 'bash scripts/slurm-cluster.sh install' first"
    if [ -f "$DIR/pids" ]; then
        local up=1 name pid
        while read -r name pid; do alive "$pid" || up=0; done <"$DIR/pids"
        if [ "$up" = 1 ] && SLURM_CONF="$DIR/slurm.conf" sinfo -h >/dev/null 2>&1; then
            log "already running in $DIR"
            echo "export SLURM_CONF=$DIR/slurm.conf"
            return 0
        fi
        cmd_stop
    fi
    rm -rf "$DIR"
    mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool"
    chmod 700 "$DIR" "$DIR/munge"
    write_conf
    export SLURM_CONF="$DIR/slurm.conf"

    # A fresh key per cluster: nothing here trusts (or is trusted by) the host's munge.
    head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    munged --foreground --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" >"$DIR/munged.out" 2>&1 &
    echo "munged $!" >"$DIR/pids"
    for _ in $(seq 50); do [ -S "$DIR/munge/munge.socket" ] && break; sleep 0.1; done
    [ -S "$DIR/munge/munge.socket" ] || die "munged did not start; see $DIR/munged.out and $DIR/munge/munged.log"

    slurmctld -D -i -f "$SLURM_CONF" >"$DIR/slurmctld.out" 2>&1 &
    echo "slurmctld $!" >>"$DIR/pids"
    slurmd -D -f "$SLURM_CONF" >"$DIR/slurmd.out" 2>&1 &
    echo "slurmd $!" >>"$DIR/pids"

    local state=""
    for _ in $(seq 150); do
        state="$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)"
        case "$state" in idle*|mixed*|allocated*) break ;; esac
        local name pid
        while read -r name pid; do
            alive "$pid" || die "$name exited during start; see $DIR/$name.out and $DIR/$name.log"
        done <"$DIR/pids"
        sleep 0.2
    done
    case "$state" in
        idle*|mixed*|allocated*) ;;
        *) cmd_stop; die "node did not become idle within 30 s (state '${state}'); see $DIR/slurmctld.log" ;;
    esac
    log "one-node cluster up in $DIR (node $(hostname -s), state $state)"
    echo "export SLURM_CONF=$DIR/slurm.conf"
}

cmd_status() {
    [ -f "$DIR/slurm.conf" ] || die "no cluster in $DIR"
    SLURM_CONF="$DIR/slurm.conf" sinfo
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 install|start|stop|status   (folder: \$BUFREUSE_SLURM_DIR, default $DIR)" >&2; exit 2 ;;
esac
