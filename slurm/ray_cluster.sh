# shellcheck shell=bash
# Start a Ray cluster over the nodes of a Slurm allocation, run launch/multinode.py on it, tear it down.
#
# Sourced by the slurm/grpo_*.sh job scripts, which call:  megarl_run_on_slurm <config.yaml> [overrides...]
# The first node of $SLURM_JOB_NODELIST is the Ray head (the batch script runs there, and so does the driver);
# every other node runs a Ray worker, started once the head says it has started. Each node's
# `ray start --block` runs as one srun step, logging to $LOG_DIR/<node>.log. SIGTERM/SIGINT (scancel, the --signal warning before the time limit) reach the driver,
# which finishes its step, writes a checkpoint and exits 0 (then the job exits 0: COMPLETED), then Ray stops on
# every node. Nodes authenticate with a per-job Ray token in $LOG_DIR (needs a shared filesystem).
#
# Environment knobs (defaults in brackets):
#   MEGARL_SLURM_CONFIG          run config, overrides the script's default recipe
#   MEGARL_SLURM_DEVICE          cuda | cpu [cuda]; cpu starts Ray with no GPUs (tests, CPU-only partitions)
#   MEGARL_SLURM_GPUS_PER_NODE   GPUs (cuda) or worker processes (cpu) per node [$SLURM_GPUS_ON_NODE or 8]
#   MEGARL_SLURM_CPUS_PER_NODE   CPUs Ray may use per node [Ray's own count; cpu device: GPUS_PER_NODE]
#   MEGARL_RAY_PORT              GCS port of the head [6379]
#   MEGARL_RAY_HEAD_IP           head address [first non-loopback IPv4 of the head; loopback only for one node]
#   MEGARL_RAY_TEMP_DIR          Ray session/socket dir [/tmp/ray_$SLURM_JOB_ID]; keep it short (socket paths)
#   MEGARL_RAY_NODE_ARGS         extra `ray start` arguments, expanded on each node (so may differ per node)
#   MEGARL_RAY_WAIT_TIMEOUT_S    how long to wait for the head to start, then for all nodes to join [600]
#   MEGARL_RAY_STOP_GRACE_S      seconds between SIGTERM and SIGKILL when stopping Ray [30]
#   MEGARL_DRIVER_STOP_GRACE_S   seconds the driver gets to finish its step and checkpoint on SIGTERM [240]
#   LOG_DIR                      per-node logs, token [logs/slurm-$SLURM_JOB_ID]
#   PYTHON                       interpreter [python]
#
# Stopping: each node's Ray is one srun step named megarl-ray-<node>; the script stops it with
# `scancel --signal=TERM <job>.<step>` (slurmd signals the step's processes: `ray start --block` drains and
# stops that node's Ray, and the step then removes the node's Ray temp dir), workers before the head, and
# `scancel --signal=KILL` on a step that outlives MEGARL_RAY_STOP_GRACE_S. Signalling the local `srun` instead
# would make srun kill its step at once (no drain), and `ray stop` would stop every Ray on the node.
# A plain `scancel <job>` gives everything KillWait seconds (often 30) before SIGKILL, too little for a
# checkpoint; `scancel --batch --signal=TERM <job>` is the pre-timeout path: a checkpoint, then COMPLETED.

MEGARL_ROOT="${MEGARL_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
PYTHON="${PYTHON:-python}"

megarl_log() { echo "[ray_cluster $(date +%H:%M:%S)] $*" >&2; }

# Node names of the allocation, one per line, head first.
megarl_slurm_nodes() {
    if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
        megarl_log "SLURM_JOB_NODELIST is not set: run this under sbatch/salloc"
        return 1
    fi
    scontrol show hostnames "$SLURM_JOB_NODELIST"
}

megarl_head_ip() {
    local head="$1"
    if [[ -n "${MEGARL_RAY_HEAD_IP:-}" ]]; then
        echo "$MEGARL_RAY_HEAD_IP"
        return
    fi
    # The first IPv4 address of the head that is not loopback: `hostname --ip-address` gives whatever /etc/hosts
    # maps the hostname to, often 127.0.0.1 or Debian's 127.0.1.1, and Ray rewrites a loopback head address to
    # each node's own, so on separate hosts every worker would dial itself. `hostname --all-ip-addresses` lists
    # the interfaces' addresses (never loopback). A single-node job may use loopback.
    local found
    found=$(srun --nodes=1 --ntasks=1 --overlap -w "$head" bash -c 'hostname --all-ip-addresses; hostname --ip-address' \
        | tr ' ' '\n' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' | grep -v -m1 -E '^127\.')
    if [[ -z "$found" && "${#MEGARL_NODES[@]}" -le 1 ]]; then
        found=127.0.0.1
    fi
    echo "$found"
}

# Start `ray start --block` on one node as a background srun step; record its pid.
megarl_start_ray_node() {
    local node="$1" role="$2"
    local -a args=(--disable-usage-stats --block --resources "{\"megarl_node:${node}\": 1}")
    if [[ "$role" == head ]]; then
        args+=(--head --node-ip-address "$MEGARL_HEAD_IP" --port "$MEGARL_RAY_PORT" --temp-dir "$MEGARL_RAY_TEMP_DIR"
               --include-dashboard false)
    else
        args+=(--address "$MEGARL_HEAD_IP:$MEGARL_RAY_PORT")
    fi
    if [[ "$MEGARL_SLURM_DEVICE" == cpu ]]; then
        args+=(--num-gpus 0 --num-cpus "${MEGARL_SLURM_CPUS_PER_NODE:-$MEGARL_SLURM_GPUS_PER_NODE}")
    else
        args+=(--num-gpus "$MEGARL_SLURM_GPUS_PER_NODE")
        [[ -n "${MEGARL_SLURM_CPUS_PER_NODE:-}" ]] && args+=(--num-cpus "$MEGARL_SLURM_CPUS_PER_NODE")
    fi
    # MEGARL_RAY_NODE_ARGS is expanded by the shell on the node (single quotes), so a node-local value wins.
    # `ray start --block` stops the node's Ray on SIGTERM (it drains first); then the temp dir goes.
    srun --nodes=1 --ntasks=1 --overlap -w "$node" --job-name "megarl-ray-$node" bash -c '
        ray start "$@" $MEGARL_RAY_NODE_ARGS &
        ray_pid=$! stopping=0
        trap "stopping=1; kill -TERM $ray_pid 2>/dev/null" TERM INT
        wait "$ray_pid"; wait "$ray_pid"; rc=$?
        rm -rf "$MEGARL_RAY_TEMP_DIR"
        ((stopping)) && rc=0  # asked to stop: ray start exits 1 after draining
        exit "$rc"' ray-node "${args[@]}" \
        >"$LOG_DIR/$node.log" 2>&1 &
    MEGARL_RAY_PIDS+=("$!")
    MEGARL_RAY_PID_NODES+=("$node")
    megarl_log "started ray $role on $node (srun pid $!, log $LOG_DIR/$node.log)"
}

# Workers join through the head's GCS and ask it for the head node's record, and a worker's `ray start` gives up
# when that takes long (a worker started beside the head on a loaded 2-core machine never joined; one started
# once the head's port listened still failed with "No node info found for head node"): they start once the
# head's `ray start` has said "Ray runtime started.", which it says after its own node is registered. 1 when the
# head exits first or does not get there within MEGARL_RAY_WAIT_TIMEOUT_S.
megarl_wait_for_head() {
    local head="$1" head_pid="$2" deadline=$((SECONDS + ${MEGARL_RAY_WAIT_TIMEOUT_S:-600}))
    until grep -q "Ray runtime started" "$LOG_DIR/$head.log" 2>/dev/null; do
        if ! kill -0 "$head_pid" 2>/dev/null; then
            megarl_log "ray head on $head exited before it started on $MEGARL_HEAD_IP:$MEGARL_RAY_PORT" \
                "(log $LOG_DIR/$head.log)"
            return 1
        fi
        if ((SECONDS >= deadline)); then
            megarl_log "ray head on $head did not start on $MEGARL_HEAD_IP:$MEGARL_RAY_PORT within" \
                "${MEGARL_RAY_WAIT_TIMEOUT_S:-600} s (MEGARL_RAY_WAIT_TIMEOUT_S; log $LOG_DIR/$head.log)"
            return 1
        fi
        sleep 1
    done
}

megarl_wait_for_cluster() {
    "$PYTHON" "$MEGARL_ROOT/launch/cluster_wait.py" --address "$MEGARL_HEAD_IP:$MEGARL_RAY_PORT" \
        --nodes "${#MEGARL_NODES[@]}" --per-node "$MEGARL_SLURM_GPUS_PER_NODE" --device "$MEGARL_SLURM_DEVICE" \
        --timeout-s "${MEGARL_RAY_WAIT_TIMEOUT_S:-600}" --whole-allocation
}

# What to signal for a step: its whole process group when its pid leads one of its own (a local step in a
# session of its own holds every Ray process of that node, and Ray's processes outlive the `ray start` that
# spawned them), else the pid alone (srun forwards the signal to its remote step). Never our own group.
megarl_signal_target() {
    local pid="$1" pgid
    pgid="$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')"
    if [[ -n "$pgid" && "$pgid" == "$pid" && "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]]; then
        echo "-$pgid"
    else
        echo "$pid"
    fi
}

megarl_signal_targets() {
    local sig="$1" target; shift
    for target in "$@"; do kill "-$sig" -- "$target" 2>/dev/null; done
}

# Wait until no process of the targets (pids or -pgid groups) is left; 1 when some outlived the timeout.
megarl_wait_targets_gone() {
    local timeout="$1"; shift
    local deadline=$((SECONDS + timeout)) target alive
    while :; do
        alive=0
        for target in "$@"; do kill -0 -- "$target" 2>/dev/null && alive=1; done
        ((alive == 0)) && return 0
        ((SECONDS >= deadline)) && return 1
        sleep 1
    done
}

# TERM the targets, wait up to the grace period, KILL whatever of them is left.
megarl_terminate() {
    local what="$1" grace="$2"; shift 2
    megarl_signal_targets TERM "$@"
    if ! megarl_wait_targets_gone "$grace" "$@"; then
        megarl_log "$what did not exit within ${grace}s of SIGTERM: sending SIGKILL"
        megarl_signal_targets KILL "$@"
        megarl_wait_targets_gone 10 "$@" || megarl_log "$what still alive 10s after SIGKILL"
    fi
}

# The Slurm step id (job.step) running Ray on a node; empty outside a real Slurm job (no squeue).
megarl_ray_step_of() {
    local node="$1"
    squeue --noheader --steps --jobs "${SLURM_JOB_ID:-}" --format "%i %j" 2>/dev/null \
        | awk -v name="megarl-ray-$node" '$2 == name { print $1; exit }'
}

# Signal the Ray step of each node: through slurmd where Slurm knows the step, else (a step without Slurm's
# bookkeeping) its local process group.
megarl_signal_ray_nodes() {
    local sig="$1" i step
    shift
    for i in "$@"; do
        step="$(megarl_ray_step_of "${MEGARL_RAY_PID_NODES[$i]}")"
        if [[ -n "$step" ]]; then
            scancel --quiet --signal="$sig" "$step" 2>/dev/null
        else
            megarl_signal_targets "$sig" "$(megarl_signal_target "${MEGARL_RAY_PIDS[$i]}")"
        fi
    done
}

# Stop the Ray steps of the given node indices: SIGTERM, wait for their srun to return, SIGKILL what is left.
megarl_stop_ray_nodes() {
    local what="$1" grace="$2" i
    shift 2
    local -a pids=()
    for i in "$@"; do pids+=("${MEGARL_RAY_PIDS[$i]}"); done
    megarl_signal_ray_nodes TERM "$@"
    if ! megarl_wait_targets_gone "$grace" "${pids[@]}"; then
        megarl_log "$what did not stop within ${grace}s of SIGTERM: sending SIGKILL"
        megarl_signal_ray_nodes KILL "$@"
        megarl_wait_targets_gone 30 "${pids[@]}" || megarl_log "$what still running 30s after SIGKILL"
    fi
}

megarl_stop_cluster() {
    [[ "${MEGARL_CLUSTER_STOPPED:-0}" == 1 ]] && return 0
    MEGARL_CLUSTER_STOPPED=1
    local grace="${MEGARL_RAY_STOP_GRACE_S:-30}" count="${#MEGARL_RAY_PIDS[@]}"
    megarl_log "stopping ray on $count node(s)"
    # Workers before the head: a worker raylet deregisters from the head's GCS on SIGTERM, and with the GCS
    # already gone it retries for a minute instead of exiting.
    ((count > 1)) && megarl_stop_ray_nodes "ray on the worker nodes" "$grace" $(seq 1 $((count - 1)))
    ((count > 0)) && megarl_stop_ray_nodes "ray on the head node" "$grace" 0
    megarl_log "ray stopped"
}

megarl_on_signal() {
    local sig="$1" driver_status=143
    megarl_log "received SIG$sig: stopping the driver and the cluster"
    if [[ -n "${MEGARL_DRIVER_PID:-}" ]] && kill -0 "$MEGARL_DRIVER_PID" 2>/dev/null; then
        # The trainer finishes its step and writes a checkpoint on SIGTERM: give it the time the pre-timeout
        # signal leaves (--signal=B:TERM@300), not the Ray stop grace.
        megarl_terminate "the driver" "${MEGARL_DRIVER_STOP_GRACE_S:-240}" "$(megarl_signal_target "$MEGARL_DRIVER_PID")"
        wait "$MEGARL_DRIVER_PID" 2>/dev/null
        driver_status=$?
    fi
    megarl_stop_cluster
    trap - EXIT
    if ((driver_status == 0)); then
        megarl_log "the driver wrote its checkpoint and exited cleanly: the job ends COMPLETED; resubmit to resume"
        exit 0
    fi
    [[ "$sig" == INT ]] && exit 130
    exit 143
}

megarl_run_on_slurm() {
    local config="${MEGARL_SLURM_CONFIG:-$1}"
    shift
    if [[ -z "$config" || ! -f "$config" ]]; then
        megarl_log "run config '$config' not found (argument 1 or MEGARL_SLURM_CONFIG)"
        return 2
    fi
    MEGARL_SLURM_DEVICE="${MEGARL_SLURM_DEVICE:-cuda}"
    if [[ "$MEGARL_SLURM_DEVICE" != cuda && "$MEGARL_SLURM_DEVICE" != cpu ]]; then
        megarl_log "MEGARL_SLURM_DEVICE must be cuda or cpu, got '$MEGARL_SLURM_DEVICE'"
        return 2
    fi
    if [[ "${SLURM_EXPORT_ENV:-}" == NONE* ]]; then
        # sbatch --export=NONE leaves SLURM_EXPORT_ENV=NONE to every srun of the job: the Ray steps would start
        # with an empty environment (no PATH: "execve(): bash: No such file or directory"). The job's own
        # environment (a login shell's, with --export=NONE) is what they need.
        megarl_log "sbatch --export=NONE: the Ray steps get the job's environment (SLURM_EXPORT_ENV=ALL)"
        export SLURM_EXPORT_ENV=ALL
    fi
    local tool
    for tool in "$PYTHON" ray; do
        if ! command -v "$tool" >/dev/null; then
            megarl_log "'$tool' is not on the job's PATH ($PATH): activate the environment that has megarl and" \
                "Ray in the job script, or submit from a shell where it is active (not with --export=NONE)"
            return 2
        fi
    done
    MEGARL_SLURM_GPUS_PER_NODE="${MEGARL_SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
    MEGARL_RAY_PORT="${MEGARL_RAY_PORT:-6379}"
    MEGARL_RAY_TEMP_DIR="${MEGARL_RAY_TEMP_DIR:-/tmp/ray_${SLURM_JOB_ID:-$$}}"
    LOG_DIR="${LOG_DIR:-$MEGARL_ROOT/logs/slurm-${SLURM_JOB_ID:-$$}}"
    mkdir -p "$LOG_DIR"
    mapfile -t MEGARL_NODES < <(megarl_slurm_nodes) || return 1
    if ((${#MEGARL_NODES[@]} == 0)); then
        megarl_log "no nodes in SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST'"
        return 1
    fi
    MEGARL_RAY_PIDS=()
    MEGARL_RAY_PID_NODES=()
    MEGARL_CLUSTER_STOPPED=0
    trap 'megarl_on_signal TERM' TERM
    trap 'megarl_on_signal INT' INT
    trap 'megarl_stop_cluster' EXIT

    # A fresh token per job: only processes that can read $LOG_DIR can join or drive this cluster.
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN_PATH="$LOG_DIR/ray_auth_token"
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH")

    local head="${MEGARL_NODES[0]}"
    MEGARL_HEAD_IP="$(megarl_head_ip "$head")"
    if [[ -z "$MEGARL_HEAD_IP" ]]; then
        megarl_log "could not find a non-loopback IPv4 address of head node $head (the other nodes could not reach"\
            "a loopback one); set MEGARL_RAY_HEAD_IP to an address of $head that they can reach"
        return 1
    fi
    export MEGARL_HEAD_IP MEGARL_RAY_PORT MEGARL_RAY_TEMP_DIR MEGARL_SLURM_DEVICE MEGARL_SLURM_GPUS_PER_NODE
    megarl_log "nodes: ${MEGARL_NODES[*]}; head $head at $MEGARL_HEAD_IP:$MEGARL_RAY_PORT; device $MEGARL_SLURM_DEVICE x $MEGARL_SLURM_GPUS_PER_NODE per node"

    megarl_start_ray_node "$head" head
    if ! megarl_wait_for_head "$head" "${MEGARL_RAY_PIDS[0]}"; then
        megarl_stop_cluster
        return 1
    fi
    local node
    for node in "${MEGARL_NODES[@]:1}"; do
        megarl_start_ray_node "$node" worker
    done
    # In the background so a trapped SIGTERM is handled at once instead of after the wait.
    megarl_wait_for_cluster &
    MEGARL_DRIVER_PID=$!
    if ! wait "$MEGARL_DRIVER_PID"; then
        megarl_log "cluster did not come up; per-node logs in $LOG_DIR"
        megarl_stop_cluster
        return 1
    fi

    local -a shape=(trainer.nnodes="${#MEGARL_NODES[@]}" trainer.n_gpus_per_node="$MEGARL_SLURM_GPUS_PER_NODE")
    [[ "$MEGARL_SLURM_DEVICE" == cpu ]] && shape+=(trainer.device=cpu)
    # The allocation's shape first, so explicit overrides on the command line still win.
    "$PYTHON" "$MEGARL_ROOT/launch/multinode.py" --config "$config" --address "$MEGARL_HEAD_IP:$MEGARL_RAY_PORT" \
        "${shape[@]}" "$@" &
    MEGARL_DRIVER_PID=$!
    # `wait` returns early when a trapped signal arrives, so the trap runs without waiting for the driver.
    local rc=0
    wait "$MEGARL_DRIVER_PID" || rc=$?
    megarl_log "driver exited with status $rc"
    megarl_stop_cluster
    return "$rc"
}
