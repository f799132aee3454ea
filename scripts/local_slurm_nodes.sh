# shellcheck shell=bash disable=SC2153  # STATE, CONF_DIR and the helpers (log, die, pid_alive, ...) are local_slurm.sh's
# The 2-node Slurm cluster of scripts/local_slurm.sh: sourced by it (functions and settings, nothing runs
# here), not run by itself. A real Slurm 22.05 cluster "arl-two" with two nodes, each a network namespace of
# this one machine with its own address and hostname, so that multi-node jobs (torchrun, NCCL/gloo
# rendezvous, a lost node) behave as on real hosts.
#
#   scripts/local_slurm.sh up --nodes 2       install if needed, build the network, start the daemons (idempotent)
#   scripts/local_slurm.sh status --nodes 2   which daemons run, and `sinfo`
#   scripts/local_slurm.sh stop-node node2    lose node2: stop its slurmd and SIGKILL everything in its netns
#   scripts/local_slurm.sh start-node node2   start its slurmd again and wait until the node is back in service
#   scripts/local_slurm.sh down --nodes 2     cancel jobs, stop what up started, delete the network and state dir
#
# Measured here (2 cores): up from nothing ~1.5 s (packages present), up again ~0.05 s, down ~5.5 s. After
# stop-node, sinfo shows the node not responding (`*`) after ~11 s, DOWN after ~19 s, when its jobs end NODE_FAIL;
# start-node has it idle again in well under a second.
#
# What `up --nodes 2` creates (needs root; only loopback and 10.77.0.0/24, no forwarding, no NAT, no route out):
#   bridge arlbr0 10.77.0.1/24 in the root netns
#     veth-arl-node1 <-> netns arl-node1: eth0 10.77.0.11, hostname node1, slurmd -N node1 on port 6818
#     veth-arl-node2 <-> netns arl-node2: eth0 10.77.0.12, hostname node2, slurmd -N node2 on port 6818
#   slurmctld in the root netns, in its own UTS+mount namespace with hostname "ctl", listening on
#     10.77.0.1:6827 only (CommunicationParameters=NoCtldInAddrAny binds what its hostname resolves to);
#     6827 because the 1-node cluster holds 6817 on 0.0.0.0.
#   Every daemon (and so every job) sees $ARL_SLURM2_DIR/hosts (localhost, ctl, node1, node2) bind-mounted on
#   /etc/hosts in its private mount namespace; the machine's /etc/hosts and /etc/slurm/slurm.conf are untouched.
#   Accounting: the 1-node cluster's slurmdbd (0.0.0.0:6819) and mariadb, reached at 10.77.0.1:6819 from the
#   root netns and from inside the node namespaces alike; munged's socket is a path, reachable from all.
#   If they are not running, up starts them (writing /etc/slurm/slurmdbd.conf, the shared daemon's config)
#   and marks them as its own under $ARL_SLURM2_DIR/run/*.ours.
#
# State, config, logs and pid files: ${ARL_SLURM2_DIR:-/tmp/arl-slurm2} (slurm.conf, hosts, log/, run/, spool/,
# state/). Per-node CPUs: ${ARL_SLURM2_CPUS:-8} (more than the machine has: SlurmdParameters=config_overrides).
# Clients use the config explicitly:
#   export SLURM_CONF=/tmp/arl-slurm2/slurm.conf; sinfo; sbatch --nodes=2 ...; sacct -j ID
#   ip netns exec arl-node1 env SLURM_CONF=/tmp/arl-slurm2/slurm.conf srun -N2 hostname
# The second form runs the client inside node1, so srun's listening sockets are not opened on the machine's
# own interfaces either. (Daemons are started with nsenter, not `ip netns exec`: the latter remounts /sys,
# hiding /sys/fs/cgroup, and slurmd 22.05 then refuses to start. For clients `ip netns exec` is fine.)
#
# Teardown (`down --nodes 2`): scancel every job and wait for them to end (so sacct records CANCELLED), stop
# both slurmd by pid file, SIGKILL whatever is left in the node namespaces (only our jobs live there), stop
# slurmctld, stop the shared daemons only if this cluster started them (or the 1-node down handed them over)
# and the 1-node cluster is not running, delete namespaces, veths and bridge, undo the /run/netns
# self bind-mount `ip netns add` made when no namespace is left, and remove the state dir.
# The cluster stays registered in the accounting database; job ids continue after the highest one recorded
# there (FirstJobId), so `sacct -j ID` never mixes a new job with one of an earlier bring-up.

N2_STATE="${ARL_SLURM2_DIR:-/tmp/arl-slurm2}"
N2_CONF="$N2_STATE/slurm.conf"
N2_CPUS="${ARL_SLURM2_CPUS:-8}"
N2_CLUSTER=arl-two
N2_BRIDGE=arlbr0
N2_CTL_IP=10.77.0.1
N2_CTL_PORT=6827
N2_SLURMD_TIMEOUT=10
N2_NODES=(node1 node2)
declare -A N2_IP=([node1]=10.77.0.11 [node2]=10.77.0.12)

n2_is_node() { [[ -n ${1:-} && -n ${N2_IP[$1]:-} ]]; }
n2_netns() { echo "arl-$1"; }
n2_veth() { echo "veth-arl-$1"; }
n2_slurmd_pidfile() { echo "$N2_STATE/run/slurmd-$1.pid"; }
n2_running() { pid_alive "$N2_STATE/run/slurmctld.pid"; }

n2_wait_until() {  # n2_wait_until SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (logs under $N2_STATE/log)"
        sleep 0.25
    done
}

n2_up() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it creates network namespaces and starts daemons)"
    install_packages
    command -v ip >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
    mkdir -p "$N2_STATE"/{state,spool,run,log}
    n2_network_up
    # sacctmgr and sacct need a config naming the accounting host; the job id floor comes from them.
    n2_running || n2_write_conf 1
    n2_start_shared
    if n2_running; then
        log "2-node: slurmctld already running"
    else
        n2_register_cluster
        n2_write_conf "$(n2_next_job_id)"
        n2_start_slurmctld
    fi
    local node
    for node in "${N2_NODES[@]}"; do
        pid_alive "$(n2_slurmd_pidfile "$node")" || n2_start_slurmd "$node"
    done
    n2_wait_nodes_in_service 30 "${N2_NODES[@]}"
    log "2-node up: $(sinfo -h -N -o '%N %T' | sort -u | paste -sd ' ') (export SLURM_CONF=$N2_CONF)"
}

n2_network_up() {
    if ! ip link show "$N2_BRIDGE" >/dev/null 2>&1; then
        log "2-node: creating bridge $N2_BRIDGE $N2_CTL_IP/24"
        ip link add "$N2_BRIDGE" type bridge forward_delay 0 stp_state 0
        ip link set "$N2_BRIDGE" addrgenmode none 2>/dev/null || true  # no IPv6 link-local address either
    fi
    ip addr replace "$N2_CTL_IP/24" dev "$N2_BRIDGE"
    ip link set "$N2_BRIDGE" up
    local node ns veth
    for node in "${N2_NODES[@]}"; do
        ns=$(n2_netns "$node") veth=$(n2_veth "$node")
        if [[ ! -e /run/netns/$ns ]]; then
            log "2-node: creating netns $ns (${N2_IP[$node]})"
            ip netns add "$ns"
        fi
        if ! ip link show "$veth" >/dev/null 2>&1; then
            # The namespace's end is called eth0, as on a real host (GLOO_SOCKET_IFNAME=eth0 would work).
            ip link add "$veth" type veth peer name eth0 netns "$ns"
            ip link set "$veth" addrgenmode none 2>/dev/null || true
            ip -n "$ns" link set eth0 addrgenmode none 2>/dev/null || true
        fi
        ip link set "$veth" master "$N2_BRIDGE" up
        ip -n "$ns" addr replace "${N2_IP[$node]}/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
    # Replaced only when it changes: running daemons hold the old file bind-mounted on their /etc/hosts.
    {
        echo "127.0.0.1 localhost"
        echo "$N2_CTL_IP ctl"
        for node in "${N2_NODES[@]}"; do echo "${N2_IP[$node]} $node"; done
    } >"$N2_STATE/hosts.tmp"
    if cmp -s "$N2_STATE/hosts.tmp" "$N2_STATE/hosts"; then rm "$N2_STATE/hosts.tmp"; else mv "$N2_STATE/hosts.tmp" "$N2_STATE/hosts"; fi
}

n2_write_conf() {  # n2_write_conf FIRST_JOB_ID
    local node nodes_conf=""
    for node in "${N2_NODES[@]}"; do
        nodes_conf+="NodeName=$node NodeAddr=${N2_IP[$node]} NodeHostname=$node CPUs=$N2_CPUS RealMemory=$(mem_mb) State=UNKNOWN"$'\n'
    done
    cat >"$N2_CONF.tmp" <<EOF
# Written by scripts/local_slurm.sh up --nodes 2 (see scripts/local_slurm_nodes.sh). A test cluster.
ClusterName=$N2_CLUSTER
# slurmctld runs with hostname "ctl" (-> $N2_CTL_IP in its hosts file); clients and slurmd dial the address.
SlurmctldHost=ctl($N2_CTL_IP)
# Bind $N2_CTL_IP (what "ctl" resolves to) instead of 0.0.0.0, which would include the machine's eth0.
CommunicationParameters=NoCtldInAddrAny
SlurmctldPort=$N2_CTL_PORT
SlurmdPort=6818
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2,kill_invalid_depend
KillWait=5
InactiveLimit=0
MinJobAge=300
# A node whose slurmd stops answering is DOWN after ${N2_SLURMD_TIMEOUT}s (node-loss tests), and back in service as
# soon as its slurmd registers again.
SlurmdTimeout=$N2_SLURMD_TIMEOUT
ReturnToService=2
# Slurm retries a refused connection for MessageTimeout seconds before it gives up on a node ("to survive
# slurmd restarts"), and pings run one round at a time: with the default 10 s a lost node's jobs ended NODE_FAIL
# ~26-29 s after the loss, with 5 s after ~19 s. Every RPC here stays on this machine: 5 s is still ample.
MessageTimeout=5
# A batch job on a lost node ends NODE_FAIL instead of being requeued behind the submitter's back: the
# launcher sees the failure in sacct and decides itself what to resubmit (a silent requeue would rerun a
# stage under the same job id while the launcher believes it is still the first attempt).
JobRequeue=0
# Job ids continue after the highest one in the accounting database (the state dir is removed by down).
FirstJobId=$1
StateSaveLocation=$N2_STATE/state
SlurmdSpoolDir=$N2_STATE/spool/%n
SlurmctldPidFile=$N2_STATE/run/slurmctld.pid
SlurmdPidFile=$N2_STATE/run/slurmd-%n.pid
SlurmctldLogFile=$N2_STATE/log/slurmctld.log
SlurmdLogFile=$N2_STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# The shared slurmdbd listens on all addresses; $N2_CTL_IP is one every client reaches, in or out of a node.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$N2_CTL_IP
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
${nodes_conf}PartitionName=debug Nodes=$(IFS=,; echo "${N2_NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$N2_CONF.tmp" "$N2_CONF"
}

# munged, mariadb and slurmdbd are the 1-node cluster's (same pid files); start the missing ones and mark
# them ours, so that down stops them when the 1-node cluster is not running.
n2_start_shared() {
    [[ -e $STATE ]] || n2_mark_shared_ours state-dir
    local name
    for name in munged mariadb slurmdbd; do
        if pid_alive "$(shared_pidfile "$name")"; then
            # slurmdbd is about to start on a running mariadb: make sure its DB user exists.
            if [[ $name == mariadb ]] && ! pid_alive "$(shared_pidfile slurmdbd)"; then start_mariadb; fi
            continue
        fi
        log "2-node: starting $name (shared with the 1-node cluster)"
        case $name in
            munged) start_munge ;;
            mariadb) start_mariadb ;;
            slurmdbd)
                [[ -e $CONF_DIR/slurmdbd.conf ]] || n2_mark_shared_ours slurmdbd-conf
                write_slurmdbd_conf
                start_slurmdbd
                ;;
        esac
        n2_mark_shared_ours "$name"
    done
}

n2_mark_shared_ours() {  # n2_mark_shared_ours NAME...
    mkdir -p "$N2_STATE/run"
    local name
    for name in "$@"; do touch "$N2_STATE/run/$name.ours"; done
}

n2_stop_shared() {
    local name
    for name in slurmdbd mariadb munged; do
        [[ -f $N2_STATE/run/$name.ours ]] || continue
        if cluster1_running; then
            log "leaving $name running: the 1-node cluster uses it (its down stops it)"
        else
            stop_pidfile "$name" "$(shared_pidfile "$name")"
        fi
    done
    cluster1_running && return
    [[ ! -f $N2_STATE/run/slurmdbd-conf.ours ]] || rm -f "$CONF_DIR/slurmdbd.conf"
    # The 1-node state dir only held the shared daemons' pid files and logs unless that cluster ran since.
    if [[ -f $N2_STATE/run/state-dir.ours && ! -e $STATE/spool ]]; then rm -rf "$STATE"; fi
}

n2_register_cluster() {
    local clusters
    clusters=$(sacctmgr -n -P list cluster format=cluster) || die "sacctmgr cannot reach slurmdbd at $N2_CTL_IP"
    grep -qx "$N2_CLUSTER" <<<"$clusters" || sacctmgr -i add cluster "$N2_CLUSTER" >/dev/null
}

n2_next_job_id() {  # 1 + the highest job id the accounting database holds for this cluster
    local ids
    ids=$(sacct -M "$N2_CLUSTER" -a -D -X -n -P -o JobIDRaw -S 1970-01-01T00:00:00 -E now) ||
        die "sacct cannot read $N2_CLUSTER's jobs from slurmdbd at $N2_CTL_IP"
    awk -F'[_.+]' '$1 ~ /^[0-9]+$/ && $1 + 0 > max { max = $1 + 0 } END { print max + 1 }' <<<"$ids"
}

n2_start_slurmctld() {
    log "2-node: starting slurmctld (hostname ctl, $N2_CTL_IP:$N2_CTL_PORT)"
    # Own UTS + mount namespace, still the root netns: hostname "ctl" makes it recognise itself as
    # SlurmctldHost, and "ctl" -> $N2_CTL_IP in its hosts file makes NoCtldInAddrAny bind that address only.
    # shellcheck disable=SC2016  # $1, $2 are the inner shell's
    unshare --uts --mount --propagation private -- /bin/sh -c \
        'mount --bind "$1" /etc/hosts && hostname ctl && exec /usr/sbin/slurmctld -f "$2" -i' \
        sh "$N2_STATE/hosts" "$N2_CONF"
    n2_wait_until 30 "slurmctld of $N2_CLUSTER" scontrol ping
}

n2_start_slurmd() {  # n2_start_slurmd NODE
    local node=$1
    log "2-node: starting slurmd $node in netns $(n2_netns "$node") (${N2_IP[$node]})"
    mkdir -p "$N2_STATE/spool/$node"
    # nsenter --net, NOT `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05 dies with
    # "Unable to initialize cgroup plugin" even with task/none. A private mount ns holds our /etc/hosts.
    # shellcheck disable=SC2016  # $1..$3 are the inner shell's
    nsenter --net="/run/netns/$(n2_netns "$node")" -- unshare --uts --mount --propagation private -- /bin/sh -c \
        'mount --bind "$1" /etc/hosts && hostname "$2" && exec /usr/sbin/slurmd -f "$3" -N "$2"' \
        sh "$N2_STATE/hosts" "$node" "$N2_CONF"
}

n2_nodes_in_service() {  # n2_nodes_in_service NODE...: 0 when each is idle, mixed or allocated
    local node state
    for node in "$@"; do
        state=$(sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n 1 || true)
        [[ $state =~ ^(idle|mixed|allocated)$ ]] || return 1
    done
}

n2_wait_nodes_in_service() {  # n2_wait_nodes_in_service SECONDS NODE...
    local limit=$1 deadline=$((SECONDS + $1)) node state resumed=""
    shift
    until n2_nodes_in_service "$@"; do
        for node in "$@"; do
            state=$(sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n 1 || true)
            # A DRAIN survives restarts (e.g. after a failed kill); DOWN returns by itself (ReturnToService=2).
            if [[ $state =~ drain|inval && $resumed != *" $node"* ]]; then
                log "2-node: $node is $state: resuming it"
                scontrol update NodeName="$node" State=RESUME || true
                resumed+=" $node"
            fi
        done
        if ((SECONDS >= deadline)); then
            die "nodes $* not in service after ${limit}s: $(sinfo -h -N -o '%N %T' 2>&1 | paste -sd ' ')" \
                "(logs: $N2_STATE/log/slurmd-NODE.log, $N2_STATE/log/slurmctld.log)"
        fi
        sleep 0.25
    done
}

n2_kill_netns() {  # n2_kill_netns NODE: SIGKILL every process in the node's netns (all are our jobs' / slurmd's)
    local ns pids deadline=$((SECONDS + 10))
    ns=$(n2_netns "$1")
    [[ -e /run/netns/$ns ]] || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null | paste -sd ' ' || true)
    [[ -n $pids ]] || return 0
    log "2-node: SIGKILL to the processes left in netns $ns: $pids"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    while [[ -n $(ip netns pids "$ns" 2>/dev/null || true) ]]; do
        ((SECONDS < deadline)) || { log "still in netns $ns after SIGKILL: $(ip netns pids "$ns" | paste -sd ' ')"; return 1; }
        sleep 0.1
    done
}

n2_down() {
    if n2_running; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null | paste -sd ' ' || true)
        if [[ -n $jobs ]]; then
            log "2-node: cancelling jobs $jobs"
            # shellcheck disable=SC2086
            scancel $jobs || true
            # Let slurmctld see them end, so sacct records them CANCELLED rather than RUNNING for ever.
            local deadline=$((SECONDS + 30))
            while [[ -n $(squeue -h -o %i 2>/dev/null || true) ]] && ((SECONDS < deadline)); do sleep 0.25; done
        fi
    fi
    local node
    for node in "${N2_NODES[@]}"; do stop_pidfile "slurmd $node" "$(n2_slurmd_pidfile "$node")" & done
    wait
    for node in "${N2_NODES[@]}"; do n2_kill_netns "$node" || true; done
    stop_pidfile slurmctld "$N2_STATE/run/slurmctld.pid"
    n2_stop_shared
    n2_network_down
    rm -rf "$N2_STATE"
    log "2-node down"
}

n2_network_down() {
    local node ns
    for node in "${N2_NODES[@]}"; do
        ns=$(n2_netns "$node")
        # Deleting one end of a veth pair deletes both, at once (a deleted netns frees its end later).
        if ip link show "$(n2_veth "$node")" >/dev/null 2>&1; then ip link del "$(n2_veth "$node")"; fi
        if [[ -e /run/netns/$ns ]]; then ip netns del "$ns"; fi
    done
    if ip link show "$N2_BRIDGE" >/dev/null 2>&1; then ip link del "$N2_BRIDGE"; fi
    # `ip netns add` made /run/netns a bind mount of itself: undo that once no namespace is left.
    if [[ -d /run/netns && -z $(ls -A /run/netns) ]]; then
        if mountpoint -q /run/netns; then umount /run/netns; fi
        rmdir /run/netns
    fi
}

n2_status() {
    local rc=0 name pidfile
    echo "2-node cluster $N2_CLUSTER: state in $N2_STATE, clients: export SLURM_CONF=$N2_CONF"
    for name in munged mariadb slurmdbd slurmctld "${N2_NODES[@]/#/slurmd-}"; do
        case $name in
            slurmctld) pidfile="$N2_STATE/run/slurmctld.pid" ;;
            slurmd-*) pidfile=$(n2_slurmd_pidfile "${name#slurmd-}") ;;
            *) pidfile=$(shared_pidfile "$name") ;;
        esac
        if pid_alive "$pidfile"; then echo "$name: running (pid $(cat "$pidfile"))"; else echo "$name: stopped"; rc=1; fi
    done
    if n2_running; then sinfo -N -o '%N %T %C %E'; fi
    return $rc
}

n2_stop_node() {  # n2_stop_node NODE: the node is lost as a crashed machine would be
    local node=$1
    [[ -e /run/netns/$(n2_netns "$node") ]] || die "no netns $(n2_netns "$node"): the 2-node cluster is not up"
    log "2-node: losing $node: stopping its slurmd, then SIGKILL to everything in its netns"
    stop_pidfile "slurmd $node" "$(n2_slurmd_pidfile "$node")"
    n2_kill_netns "$node" || die "processes survived SIGKILL in netns $(n2_netns "$node")"
    log "2-node: $node is lost; slurmctld marks it DOWN in ~20 s (SlurmdTimeout=${N2_SLURMD_TIMEOUT}s + ping rounds), its jobs then end NODE_FAIL"
}

n2_start_node() {  # n2_start_node NODE
    local node=$1
    n2_running || die "slurmctld of the 2-node cluster is not running: scripts/local_slurm.sh up --nodes 2"
    [[ -e /run/netns/$(n2_netns "$node") ]] || die "no netns $(n2_netns "$node"): the 2-node cluster is not up"
    pid_alive "$(n2_slurmd_pidfile "$node")" || n2_start_slurmd "$node"
    n2_wait_nodes_in_service 30 "$node"
    log "2-node: $node back: $(sinfo -h -N -n "$node" -o %T | head -n 1)"
}
