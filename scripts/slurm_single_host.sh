#!/usr/bin/env bash
# A real two-node Slurm cluster on this one host, for the Slurm tests (tests/e2e/launch/test_slurm_real.py) and CI:
# munge, slurmctld and two slurmd (nodes n1, n2, each with its own port), Debian's slurm-wlm.
#
#   bash scripts/slurm_single_host.sh up     # install if missing (apt, needs root), configure, start, wait
#   bash scripts/slurm_single_host.sh down   # stop slurmctld, both slurmd and munged
#
# Two raylets on one host would collide on Ray's fixed default ports; a TaskProlog gives each node its own
# through MEGARL_RAY_NODE_ARGS (on real clusters every node is its own host and this is not needed).
set -euo pipefail

CONF_DIR=/etc/slurm
HOST="$(hostname -s)"
CPUS_PER_NODE="${MEGARL_SLURM_TEST_CPUS:-2}"

log() { echo "[slurm_single_host] $*" >&2; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return 0
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
        log "Slurm is not installed and this is not a root Debian/Ubuntu machine: cannot install it"
        return 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
    if [[ -f "$CONF_DIR/slurm.conf" ]] && ! grep -q '^ClusterName=megarl-test$' "$CONF_DIR/slurm.conf"; then
        log "$CONF_DIR/slurm.conf exists and is not this script's: not touching a real Slurm set-up"
        return 1
    fi
    mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd/n1 /var/spool/slurmd/n2 /var/log/slurm
    chown slurm:slurm /var/spool/slurmctld
    cat >"$CONF_DIR/slurm.conf" <<EOF
ClusterName=megarl-test
SlurmctldHost=$HOST
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/affinity
TaskProlog=$CONF_DIR/taskprolog.sh
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=30
InactiveLimit=0
MinJobAge=600
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$CONF_DIR/cgroup.conf" <<'EOF'
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    cat >"$CONF_DIR/taskprolog.sh" <<'EOF'
#!/bin/bash
case "$SLURMD_NODENAME" in n1) i=0 ;; n2) i=1 ;; *) exit 0 ;; esac
echo "export MEGARL_RAY_NODE_ARGS=--dashboard-agent-listen-port $((52410 + i)) --metrics-export-port $((52420 + i)) --min-worker-port $((21000 + 1000 * i)) --max-worker-port $((21999 + 1000 * i))"
EOF
    chmod 755 "$CONF_DIR/taskprolog.sh"
}

start_daemons() {
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -f "slurmd -N n1" >/dev/null || slurmd -N n1
    pgrep -f "slurmd -N n2" >/dev/null || slurmd -N n2
    local deadline=$((SECONDS + 60))
    until [[ "$(sinfo -h -o '%D %t' 2>/dev/null)" == "2 idle" ]]; do
        if ((SECONDS >= deadline)); then
            log "the two nodes did not become idle within 60 s: $(sinfo 2>&1 | tr '\n' ' ')"
            return 1
        fi
        sleep 1
        # a node left DOWN by an earlier run of this host comes back with ReturnToService=2 once slurmd
        # registers; one left DRAINED needs this
        scontrol update nodename=n[1-2] state=resume >/dev/null 2>&1 || true
    done
    log "up: $(sinfo -h -o '%P %D %t %N')"
}

stop_daemons() {
    scontrol shutdown >/dev/null 2>&1 || true
    pkill -x munged 2>/dev/null || true
}

case "${1:-}" in
    up) install_packages && write_config && start_daemons ;;
    down) stop_daemons ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
