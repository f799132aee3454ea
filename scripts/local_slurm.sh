#!/usr/bin/env bash
# Real Slurm 22.05 clusters (with accounting) on this one machine, for tests and CI.
#
#   scripts/local_slurm.sh up       install if needed, start munge, mariadb, slurmdbd, slurmctld, slurmd (idempotent)
#   scripts/local_slurm.sh down     cancel every job, then stop the daemons by their pid files
#   scripts/local_slurm.sh status   which daemons run, and `sinfo`
#   scripts/local_slurm.sh up|down|status --nodes 2     the 2-node cluster "arl-two" (network namespaces)
#   scripts/local_slurm.sh stop-node|start-node NAME    lose / bring back node1 or node2 of the 2-node cluster
#
# `--nodes 1` (the default) is the single-node cluster described here; `--nodes 2` and the node commands are
# documented at the top of scripts/local_slurm_nodes.sh. Both clusters can run at the same time: they share
# munged, mariadb and slurmdbd, and whichever cluster goes down last stops those.
#
# Why each setting (docs/operations.md, "A Slurm cluster on one machine"): no systemd, Slurm state under $ARL_SLURM_DIR
# (default /tmp/arl-slurm), accounting so that sacct/submitit see cancels, `config_overrides` so the
# node may announce more CPUs than the machine has (several stage jobs at once on 2 cores).
# Daemons are stopped by pid file only, never by name. Needs root (it writes /etc/slurm).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

STATE="${ARL_SLURM_DIR:-/tmp/arl-slurm}"
CPUS="${ARL_SLURM_CPUS:-16}"
CLUSTER="arl-local"
DB_PASS="arl-local-slurmdbd"
CONF_DIR=/etc/slurm

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

pid_alive() {  # pid_alive PIDFILE -> 0 when the file names a live process
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_until() {  # wait_until SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (logs under $STATE/log)"
        sleep 0.5
    done
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then
        return
    fi
    [[ $(id -u) -eq 0 ]] || die "installing Slurm needs root"
    log "installing munge, Slurm and MariaDB (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        munge slurmctld slurmd slurm-client slurmdbd mariadb-server >/dev/null
}

mem_mb() { awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.8}' /proc/meminfo; }

write_configs() {
    write_slurm_conf
    write_slurmdbd_conf
}

write_slurm_conf() {
    mkdir -p "$STATE"/{log,run,spool/ctld,spool/d} "$CONF_DIR"
    local mem_mb
    mem_mb=$(mem_mb)
    cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by scripts/local_slurm.sh: a single-node test cluster. Do not use in production.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2,kill_invalid_depend
KillWait=5
ReturnToService=2
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

# The accounting daemon's config, shared by both clusters (each cluster's slurm.conf points at this slurmdbd).
write_slurmdbd_conf() {
    mkdir -p "$STATE"/{log,run} "$CONF_DIR"
    # slurmdbd refuses a config readable by others (it holds the DB password).
    umask 077
    cat >"$CONF_DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$CONF_DIR/slurmdbd.conf"
    umask 022
}

start_munge() {
    local pidfile=/run/munge/munged.pid
    pid_alive "$pidfile" && return
    mkdir -p /run/munge && chown munge:munge /run/munge
    [[ -s /etc/munge/munge.key ]] || runuser -u munge -- /usr/sbin/mungekey --create
    runuser -u munge -- /usr/sbin/munged --pid-file="$pidfile"
    wait_until 10 "munged" munge -n
}

start_mariadb() {
    local pidfile=/run/mysqld/mariadb.pid  # mariadbd runs as mysql: it writes its pid file there
    if ! pid_alive "$pidfile"; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        nohup /usr/sbin/mariadbd --user=mysql --pid-file="$pidfile" >"$STATE/log/mariadb.log" 2>&1 &
        wait_until 30 "mariadb" mariadb -e "SELECT 1"
    fi
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

start_slurmdbd() {
    pid_alive "$STATE/run/slurmdbd.pid" && return
    # slurmdbd looks for slurmdbd.conf next to $SLURM_CONF: pin it to this one's.
    SLURM_CONF="$CONF_DIR/slurm.conf" /usr/sbin/slurmdbd
    wait_until 30 "slurmdbd" sacctmgr -n list cluster
}

start_slurm_daemons() {
    start_slurmdbd
    # The cluster must exist in the database before slurmctld registers with it.
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if ! pid_alive "$STATE/run/slurmctld.pid"; then
        /usr/sbin/slurmctld
        wait_until 30 "slurmctld" scontrol ping
    fi
    if ! pid_alive "$STATE/run/slurmd.pid"; then
        /usr/sbin/slurmd -N localhost
    fi
    wait_until 30 "the node to register" node_usable
    # A DRAIN/DOWN state survives restarts (e.g. after an earlier INVAL config): clear it.
    if sinfo -h -N -o %T | grep -Eq 'drain|down|inval'; then
        scontrol update NodeName=localhost State=RESUME || true
        wait_until 30 "the node to resume" node_idle_or_busy
    fi
}

node_usable() { [[ -n $(sinfo -h -N -o %T 2>/dev/null) ]] && ! sinfo -h -N -o %T | grep -q '\*$\|unknown'; }
node_idle_or_busy() { sinfo -h -N -o %T | grep -Eq '^(idle|mixed|allocated)$'; }

cmd_up() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it writes $CONF_DIR and starts daemons)"
    install_packages
    write_configs
    start_munge
    start_mariadb
    start_slurm_daemons
    log "up: $(sinfo -h -o '%P %a %D %T %N' | head -n 1) (state in $STATE)"
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE
    local pidfile=$2
    if ! pid_alive "$pidfile"; then rm -f "$pidfile"; return; fi
    local pid
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return; }; sleep 0.25; done
    log "$1 (pid $pid) did not stop after SIGTERM; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

cmd_down() {
    # A stopped slurmd does not kill running jobs: cancel them first, and let them end.
    if pid_alive "$STATE/run/slurmctld.pid"; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            scancel $jobs || true
            for _ in $(seq 1 60); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
        fi
    fi
    stop_pidfile slurmd "$STATE/run/slurmd.pid"
    stop_pidfile slurmctld "$STATE/run/slurmctld.pid"
    if n2_running; then
        # The 2-node cluster still needs accounting and munge: hand them over, its `down` stops them.
        log "leaving munged, mariadb and slurmdbd running for the 2-node cluster ($N2_STATE); its down stops them"
        n2_mark_shared_ours munged mariadb slurmdbd
    else
        stop_shared_daemons slurmdbd mariadb munged
    fi
    log "down"
}

shared_pidfile() {  # shared_pidfile munged|mariadb|slurmdbd -> its pid file
    case $1 in
        munged) echo /run/munge/munged.pid ;;
        mariadb) echo /run/mysqld/mariadb.pid ;;
        slurmdbd) echo "$STATE/run/slurmdbd.pid" ;;
        *) die "unknown shared daemon $1" ;;
    esac
}

stop_shared_daemons() {  # stop_shared_daemons NAME... (stopped in this order)
    local name
    for name in "$@"; do stop_pidfile "$name" "$(shared_pidfile "$name")"; done
}

cluster1_running() { pid_alive "$STATE/run/slurmctld.pid"; }

cmd_status() {
    local rc=0 name pidfile
    for name in munged mariadb slurmdbd slurmctld slurmd; do
        case $name in
            munged) pidfile=/run/munge/munged.pid ;;
            mariadb) pidfile=/run/mysqld/mariadb.pid ;;
            *) pidfile="$STATE/run/$name.pid" ;;
        esac
        if pid_alive "$pidfile"; then echo "$name: running (pid $(cat "$pidfile"))"; else echo "$name: stopped"; rc=1; fi
    done
    if ((rc == 0)); then sinfo; fi
    return $rc
}

# The 2-node cluster: settings and functions only, nothing runs when it is sourced.
# shellcheck source=scripts/local_slurm_nodes.sh
source "$HERE/local_slurm_nodes.sh"

usage() {
    echo "usage: $0 up|down|status [--nodes 1|2] | stop-node|start-node node1|node2" >&2
    exit 2
}

main() {
    local cmd=${1:-} nodes=1
    [[ $# -gt 0 ]] && shift
    case $cmd in
        up | down | status)
            while [[ $# -gt 0 ]]; do
                case $1 in
                    --nodes) [[ $# -ge 2 ]] || usage; nodes=$2; shift 2 ;;
                    --nodes=*) nodes=${1#--nodes=}; shift ;;
                    *) usage ;;
                esac
            done
            [[ $nodes == 1 || $nodes == 2 ]] || usage
            ;;
        stop-node | start-node)
            if [[ $# -ne 1 ]] || ! n2_is_node "$1"; then usage; fi
            ;;
        *) usage ;;
    esac
    if [[ $cmd == *-node || $nodes == 2 ]]; then
        export SLURM_CONF="$N2_CONF"
    else
        # The default config even when the caller's shell points SLURM_CONF at the 2-node cluster.
        export SLURM_CONF="$CONF_DIR/slurm.conf"
    fi
    case $cmd/$nodes in
        up/1) cmd_up ;;
        down/1) cmd_down ;;
        status/1) cmd_status ;;
        up/2) n2_up ;;
        down/2) n2_down ;;
        status/2) n2_status ;;
        stop-node/*) n2_stop_node "$1" ;;
        start-node/*) n2_start_node "$1" ;;
    esac
}

main "$@"
