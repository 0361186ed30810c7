#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the SLURM path of cleanba (job arrays, srun's
# multi-process runs, preemption and requeue) for real: Debian's slurm-wlm and munge, one node with
# every CPU of the machine, requeue allowed, no cgroups (proctrack/linuxproc). Two partitions on the
# node: `local` (the default) and `urgent`, whose jobs preempt those of `local` as a cluster's
# higher-priority partition does (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE: SIGTERM,
# KillWait seconds, then the job goes back to the queue).
#
#   benchmark/slurm_local.sh start    install the packages if missing, start munged, slurmctld and
#                                     slurmd, wait until the node is idle
#   benchmark/slurm_local.sh stop     stop exactly the daemons `start` started
#   benchmark/slurm_local.sh status   the node as sinfo sees it
#
# Needs root (apt and the daemons). Idempotent: `start` on a running cluster, or `stop` on a stopped
# one, says so and exits 0. Its files live in $CLEANBA_SLURM_DIR (default /tmp/cleanba-slurm):
# the daemons' logs, pid files and state.
set -euo pipefail

DIR=${CLEANBA_SLURM_DIR:-/tmp/cleanba-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s)

fail() {
    echo "slurm_local: $*" >&2
    exit 1
}

pid_file() {  # munged runs as user munge, in a folder of its own
    if [[ $1 == munged ]]; then echo "$DIR/munge/munged.pid"; else echo "$DIR/$1.pid"; fi
}

running() {  # running DAEMON: its pid file names a live process
    local file
    file=$(pid_file "$1")
    [[ -s $file ]] && kill -0 "$(cat "$file" 2>/dev/null)" 2>/dev/null
}

node_state() {
    sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1
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

config() {
    local memory_mb
    memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    cat <<EOF
# Written by cleanba's benchmark/slurm_local.sh: one node, $(nproc) CPUs, requeue allowed, partition urgent preempts local.
ClusterName=cleanba
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
KillWait=30
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
NodeName=$NODE CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=$NODE MaxTime=INFINITE State=UP PriorityTier=2
EOF
}

write_config() {
    mkdir -p /etc/slurm "$DIR/state" "$DIR/spool"
    config >"$CONF"
}

start() {
    mkdir -p "$DIR"
    if running slurmctld && running slurmd && [[ $(node_state) == idle* || $(node_state) == mixed* || $(node_state) == allocated* ]]; then
        if [[ "$(config)" != "$(cat "$CONF")" ]]; then
            # A cluster started by an earlier version of this script: its queued and running jobs
            # survive a restart of the controller, which reads the new configuration.
            write_config
            kill "$(cat "$(pid_file slurmctld)")"
            while running slurmctld; do sleep 0.1; done
            slurmctld || fail "slurmctld did not restart (see $DIR/slurmctld.log)"
            for _ in $(seq 60); do
                [[ $(node_state) == unknown* ]] || break
                sleep 0.5
            done
            echo "the local SLURM cluster's configuration is updated"
        fi
        echo "the local SLURM cluster is already running: node $NODE $(node_state)"
        return
    fi
    install_packages
    [[ -s /etc/munge/munge.key ]] || fail "no munge key at /etc/munge/munge.key (reinstall munge)"
    write_config
    if ! running munged; then
        mkdir -p /run/munge "$DIR/munge"
        chown munge:munge /run/munge "$DIR/munge"
        runuser -u munge -- munged --pid-file="$DIR/munge/munged.pid" \
            --log-file="$DIR/munge/munged.log" ||
            fail "munged did not start (see $DIR/munge/munged.log)"
    fi
    if ! running slurmctld; then
        slurmctld || fail "slurmctld did not start (see $DIR/slurmctld.log)"
    fi
    if ! running slurmd; then
        slurmd || fail "slurmd did not start (see $DIR/slurmd.log)"
    fi
    for _ in $(seq 60); do
        case $(node_state) in
        idle*)
            echo "the local SLURM cluster is running: node $NODE idle, $(nproc) CPUs, partitions local and urgent"
            return
            ;;
        esac
        sleep 0.5
    done
    fail "node $NODE is not idle after 30 s (state: $(node_state || true); see $DIR/slurmd.log and $DIR/slurmctld.log)"
}

stop() {
    local stopped=0
    for daemon in slurmd slurmctld munged; do
        if running "$daemon"; then
            kill "$(cat "$(pid_file "$daemon")")"
            for _ in $(seq 50); do
                running "$daemon" || break
                sleep 0.1
            done
            running "$daemon" && fail "$daemon (pid $(cat "$(pid_file "$daemon")")) did not stop"
            stopped=$((stopped + 1))
        fi
        rm -f "$(pid_file "$daemon")"
    done
    if ((stopped)); then
        echo "the local SLURM cluster is stopped"
    else
        echo "the local SLURM cluster was not running"
    fi
}

status() {
    if running slurmctld && running slurmd; then
        sinfo
    else
        echo "the local SLURM cluster is not running"
        exit 3
    fi
}

case ${1:-} in
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: benchmark/slurm_local.sh start|stop|status" >&2
    exit 2
    ;;
esac
