#!/usr/bin/env bash
# A SLURM cluster on this machine, to try the SLURM path of cleanba (job arrays, srun's multi-process
# runs, preemption, requeue, runs across nodes and a node that fails) for real: Debian's slurm-wlm and
# munge, requeue allowed, no cgroups (proctrack/linuxproc). One node by default, named as the machine;
# with --nodes N, N nodes NAME1 .. NAMEN served by N slurmd daemons of this machine (each with a port,
# spool folder, pid file and log of its own), their names resolvable through a line of /etc/hosts.
# Every node has every CPU of the machine (SlurmdParameters=config_overrides), so that a job that fits
# one node fits each: several nodes share the machine's CPUs. Two partitions over all nodes: `local`
# (the default) and `urgent`, whose jobs preempt those of `local` as a cluster's higher-priority
# partition does (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE: SIGTERM, KillWait seconds,
# then the job goes back to the queue). A node whose slurmd stops answering is DOWN after
# SlurmdTimeout seconds, and its jobs fail over (NODE_FAIL; a job with --requeue is queued again).
#
#   benchmark/slurm_local.sh start [--nodes N]   install the packages if missing, start munged,
#                                     slurmctld and the nodes' slurmd, wait until every node is idle;
#                                     a running cluster of another size or an older configuration is
#                                     restarted with the new one (without --nodes: a running cluster
#                                     keeps its size, else one node)
#   benchmark/slurm_local.sh stop     stop exactly the daemons `start` started and restore what it
#                                     changed: /etc/slurm/slurm.conf and /etc/hosts
#   benchmark/slurm_local.sh status   the nodes as sinfo sees them
#   benchmark/slurm_local.sh kill-node NAME      the node dies as a machine does: its slurmd and every
#                                     process of its job steps get SIGKILL
#   benchmark/slurm_local.sh revive-node NAME    start the node's slurmd again; it rejoins the cluster
#
# Needs root (apt, the daemons, /etc). Idempotent: `start` on a running cluster of the same size, or
# `stop` on a stopped one, says so and exits 0. Its files live in $CLEANBA_SLURM_DIR (default
# /tmp/cleanba-slurm): the daemons' logs, pid files and state, and the files it replaced.
set -euo pipefail

DIR=${CLEANBA_SLURM_DIR:-/tmp/cleanba-slurm}
CONF=/etc/slurm/slurm.conf
HOSTS=/etc/hosts
HOST=$(hostname -s)
MARK="# cleanba benchmark/slurm_local.sh"
FIRST_PORT=17001
SLURMD_TIMEOUT=15

fail() {
    echo "slurm_local: $*" >&2
    exit 1
}

usage_error() {  # a user's mistake: one line, exit 2
    echo "slurm_local: error: $*" >&2
    exit 2
}

num_nodes() {  # the size of the cluster that start wrote, 0 if none
    cat "$DIR/nodes" 2>/dev/null || echo 0
}

node_names() {  # node_names N: one node named as the machine, or NAME1 .. NAMEN
    if (($1 == 1)); then
        echo "$HOST"
    elif (($1 > 1)); then
        for i in $(seq "$1"); do echo "$HOST$i"; done
    fi
}

pid_file() {  # munged runs as user munge, in a folder of its own; slurmd-NODE: a node's slurmd
    if [[ $1 == munged ]]; then echo "$DIR/munge/munged.pid"; else echo "$DIR/$1.pid"; fi
}

running() {  # running DAEMON: its pid file names a live process
    local file
    file=$(pid_file "$1")
    [[ -s $file ]] && kill -0 "$(cat "$file" 2>/dev/null)" 2>/dev/null
}

node_state() {
    sinfo --noheader --nodes="$1" --format=%T 2>/dev/null | head -n 1
}

all_up() {  # all_up N: every node of N answers, idle or running jobs
    local name
    for name in $(node_names "$1"); do
        [[ $(node_state "$name") =~ ^(idle|mixed|allocated) ]] || return 1
    done
}

install_packages() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    [[ $(id -u) == 0 ]] || fail "installing slurm-wlm and munge needs root (apt-get)"
    echo "installing slurm-wlm and munge"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1; then
        apt-get update -q >>"$DIR/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$DIR/apt.log" 2>&1 ||
            fail "apt-get could not install slurm-wlm and munge (see $DIR/apt.log)"
    fi
}

config() {  # config N: the slurm.conf of N nodes
    local memory_mb names port name
    memory_mb=$(awk -v n="$1" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
    names=$(node_names "$1" | paste -sd, -)
    echo "# Written by cleanba's benchmark/slurm_local.sh: $1 node(s) on this machine, $(nproc) CPUs each, requeue allowed, partition urgent preempts local."
    echo "ClusterName=cleanba"
    echo "SlurmctldHost=$HOST"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "MpiDefault=none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "JobRequeue=1"
    echo "KillWait=30"
    echo "SlurmdTimeout=$SLURMD_TIMEOUT"
    echo "PreemptType=preempt/partition_prio"
    echo "PreemptMode=REQUEUE"
    echo "ReturnToService=2"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/slurmctld.log"
    echo "SlurmdLogFile=$DIR/slurmd-%n.log"
    port=$FIRST_PORT
    for name in $(node_names "$1"); do
        echo "NodeName=$name NodeHostname=$HOST Port=$port CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN"
        port=$((port + 1))
    done
    echo "PartitionName=local Nodes=$names Default=YES MaxTime=INFINITE State=UP PriorityTier=1"
    echo "PartitionName=urgent Nodes=$names MaxTime=INFINITE State=UP PriorityTier=2"
}

ours() {  # ours FILE: a configuration this script wrote
    [[ -f $1 ]] && head -n 1 "$1" | grep -q "^# Written by cleanba's benchmark/slurm_local.sh"
}

write_config() {  # write_config N; the first time, keeps the configuration it replaces
    local name
    mkdir -p /etc/slurm "$DIR/state"
    for name in $(node_names "$1"); do mkdir -p "$DIR/spool/$name"; done
    if [[ -f $CONF ]] && ! ours "$CONF" && [[ ! -f $DIR/slurm.conf.before ]]; then
        cp -p "$CONF" "$DIR/slurm.conf.before"
    fi
    config "$1" >"$CONF"
    echo "$1" >"$DIR/nodes"
}

resolve_names() {  # resolve_names N: the names of several nodes resolve to this machine (one /etc/hosts line)
    local line
    line=$(grep -v -- "$MARK\$" "$HOSTS" || true)
    if (($1 > 1)); then
        line="$line"$'\n'"127.0.0.1 $(node_names "$1" | paste -sd' ' -) $MARK"
    fi
    # /etc/hosts may be a mount point: rewrite it in place rather than replace it.
    printf '%s\n' "$line" >"$HOSTS"
}

start_slurmd() {  # start_slurmd NAME
    running "slurmd-$1" && return
    slurmd -N "$1" || fail "slurmd of node $1 did not start (see $DIR/slurmd-$1.log)"
}

stop_daemon() {  # stop_daemon DAEMON: SIGTERM, then wait until it has exited; fails if it was not running
    running "$1" || return 1
    kill "$(cat "$(pid_file "$1")")"
    for _ in $(seq 100); do
        running "$1" || break
        sleep 0.1
    done
    running "$1" && fail "$1 (pid $(cat "$(pid_file "$1")")) did not stop"
    rm -f "$(pid_file "$1")"
}

stop_nodes() {  # the slurmd of every node that start wrote (and the one of an older version of this script)
    local name
    local stopped=0
    for name in $(node_names "$(num_nodes)"); do
        stop_daemon "slurmd-$name" && stopped=$((stopped + 1))
    done
    stop_daemon slurmd && stopped=$((stopped + 1))
    echo "$stopped"
}

start() {
    local nodes=1
    local name
    case ${1:-} in
    "") # the size of the running cluster, else one node
        running slurmctld && (($(num_nodes) > 0)) && nodes=$(num_nodes)
        ;;
    --nodes)
        [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || usage_error "--nodes needs a number of nodes, 1 or more (got '${2:-}')"
        nodes=$2
        ;;
    *) usage_error "unknown option '$1' of start; the one option is --nodes N" ;;
    esac
    mkdir -p "$DIR"
    if running slurmctld && [[ "$(config "$nodes")" == "$(cat "$CONF" 2>/dev/null)" ]] && all_up "$nodes"; then
        echo "the local SLURM cluster is already running: $(node_names "$nodes" | paste -sd' ' -), $(nproc) CPUs each"
        return
    fi
    install_packages
    [[ -s /etc/munge/munge.key ]] || fail "no munge key at /etc/munge/munge.key (reinstall munge)"
    if running slurmctld; then
        # A cluster of another size, or one started by an earlier version of this script: its
        # daemons restart with the new configuration (queued jobs survive where their nodes do).
        stop_nodes >/dev/null
        stop_daemon slurmctld
        echo "restarting the local SLURM cluster with $nodes node(s)"
    fi
    write_config "$nodes"
    resolve_names "$nodes"
    if ! running munged; then
        mkdir -p /run/munge "$DIR/munge"
        chown munge:munge /run/munge "$DIR/munge"
        runuser -u munge -- munged --pid-file="$DIR/munge/munged.pid" \
            --log-file="$DIR/munge/munged.log" ||
            fail "munged did not start (see $DIR/munge/munged.log)"
    fi
    slurmctld || fail "slurmctld did not start (see $DIR/slurmctld.log)"
    for name in $(node_names "$nodes"); do start_slurmd "$name"; done
    for _ in $(seq 60); do
        if all_up "$nodes"; then
            echo "the local SLURM cluster is running: $(node_names "$nodes" | paste -sd' ' -) idle, $(nproc) CPUs each, partitions local and urgent"
            return
        fi
        sleep 0.5
    done
    fail "the nodes are not idle after 30 s ($(sinfo --noheader -N --format='%N %T' 2>/dev/null | paste -sd' ' - || true); see the logs in $DIR)"
}

stop() {
    local stopped
    stopped=$(stop_nodes)
    stop_daemon slurmctld && stopped=$((stopped + 1))
    stop_daemon munged && stopped=$((stopped + 1))
    if [[ -f $DIR/slurm.conf.before ]]; then
        mv "$DIR/slurm.conf.before" "$CONF"
    elif ours "$CONF"; then
        rm -f "$CONF"
    fi
    resolve_names 1
    rm -f "$DIR/nodes"
    if ((stopped)); then
        echo "the local SLURM cluster is stopped"
    else
        echo "the local SLURM cluster was not running"
    fi
}

status() {
    if running slurmctld; then
        sinfo -N
    else
        echo "the local SLURM cluster is not running"
        exit 3
    fi
}

check_node() {  # check_node NAME: NAME is a node that start wrote
    node_names "$(num_nodes)" | grep -qx -- "$1" ||
        usage_error "'$1' is not a node of the local cluster (its nodes: $(node_names "$(num_nodes)" | paste -sd' ' -))"
}

descendants() {  # descendants PID: every process under PID
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child $(descendants "$child")"
    done
}

kill_node() {
    local name=$1
    local victims stepd
    check_node "$name"
    running "slurmd-$name" || fail "node $name is not running (revive it: benchmark/slurm_local.sh revive-node $name)"
    # The node's job steps: each slurmstepd started by this node's slurmd (it holds the node's log
    # open), and every process under them. All get SIGKILL at once, with the slurmd, as when a
    # machine loses power.
    victims=$(cat "$(pid_file "slurmd-$name")")
    for stepd in $(pgrep '^slurmstepd' || true); do
        if ls -l "/proc/$stepd/fd" 2>/dev/null | grep -q -- "$DIR/slurmd-$name.log\$"; then
            victims="$victims $stepd $(descendants "$stepd")"
        fi
    done
    # shellcheck disable=SC2086
    kill -KILL $victims 2>/dev/null || true
    rm -f "$(pid_file "slurmd-$name")"
    echo "node $name killed: its slurmd and $(($(echo $victims | wc -w) - 1)) processes of its job steps"
}

revive_node() {
    check_node "$1"
    start_slurmd "$1"
    echo "node $1 is started again"
}

case ${1:-} in
start) start "${@:2}" ;;
stop) stop ;;
status) status ;;
kill-node | revive-node)
    [[ -n ${2:-} ]] || usage_error "$1 needs a node name (sinfo -N lists them)"
    if [[ $1 == kill-node ]]; then kill_node "$2"; else revive_node "$2"; fi
    ;;
*)
    echo "usage: benchmark/slurm_local.sh start [--nodes N] | stop | status | kill-node NAME | revive-node NAME" >&2
    exit 2
    ;;
esac
