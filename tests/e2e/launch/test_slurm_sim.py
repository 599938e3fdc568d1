"""Run the real slurm/grpo_7b.sh in a simulated two-node Slurm allocation on this machine: the cluster checks
that need no Slurm daemons (placement, a too-small cluster, the head address, config errors). Training,
resubmission, scancel and the pre-timeout signal run under real Slurm in tests/e2e/launch/test_slurm_real.py.

The simulation is only the Slurm side: `srun` and `scontrol` shims on PATH (srun -w NODE runs the step
locally in its own session with that node's environment; scontrol expands `prefix[a-b]` nodelists).
Everything else is real: slurm/ray_cluster.sh starts a real Ray head and a real Ray worker "node" on this
machine (each with its own ports), launch/cluster_wait.py and launch/multinode.py attach to it, reserve a
placement group per node and print the placement. Teardown kills, by PID, every process the run started
(found by this test's unique Ray temp dir, port and log dir), whatever happened.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from tests.paths import REPO


SRUN_SHIM = r"""#!/bin/bash
# Simulated srun: run the step on this machine as if on the node given by -w, in a session of its own.
node=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -w|--nodelist) node="$2"; shift 2 ;;
        --nodelist=*) node="${1#*=}"; shift ;;
        --nodes=*|--ntasks=*|--overlap|--exclusive|--kill-on-bad-exit*) shift ;;
        --nodes|--ntasks|-N|-n|--job-name|-J) shift 2 ;;
        --job-name=*) shift ;;
        --) shift; break ;;
        -*) echo "sim srun: unsupported option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [[ -z "$node" ]]; then echo "sim srun: only -w NODE steps are simulated" >&2; exit 2; fi
echo "$node $*" >>"$SIM_DIR/srun_calls.log"
if [[ -f "$SIM_DIR/nodes/$node.env" ]]; then set -a; source "$SIM_DIR/nodes/$node.env"; set +a; fi
export SLURMD_NODENAME="$node"
exec setsid "$@"
"""

SCONTROL_SHIM = r"""#!/bin/bash
# Simulated scontrol: only `scontrol show hostnames LIST` with LIST like a,b or prefix[1-3,5].
if [[ "$1 $2" != "show hostnames" ]]; then echo "sim scontrol: unsupported: $*" >&2; exit 2; fi
exec python3 - "$3" <<'EOF'
import re, sys
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[1]):
    m = re.fullmatch(r"(.*)\[(.*)\]", part)
    if not m:
        print(part); continue
    for item in m.group(2).split(","):
        lo, _, hi = item.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{m.group(1)}{str(i).zfill(len(lo))}")
EOF
"""

TINY_CONFIG = """\
data:
  train_files: [embedded:digits]
  val_files: [embedded:digits]
  max_prompt_length: 32
  max_response_length: 4
  train_batch_size: 16
actor_rollout_ref:
  model:
    path: embedded:tiny-qwen2
  actor:
    ppo_mini_batch_size: 16
    ppo_micro_batch_size_per_gpu: 8
    megatron:
      tensor_model_parallel_size: 2
      use_distributed_optimizer: false
      params_dtype: float32  # fp32 on CPU (the production default is bfloat16)
  rollout:
    name: hf
    dtype: float32
    n: 2
    log_prob_micro_batch_size_per_gpu: 8
trainer:
  experiment_name: slurm_sim
  total_training_steps: 2
  save_freq: -1
  test_freq: -1
  val_before_train: false
  progress_bar: false
  nnodes: 2
  n_gpus_per_node: 2
  device: cpu
  worker_timeout_s: 120
"""


def processes_matching(markers: list[str]) -> list[int]:
    """PIDs whose command line mentions one of ``markers`` (this test's temp dir, port, log dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in markers):
            found.append(int(entry.name))
    return found


def wait_until_gone(markers: list[str], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_matching(markers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def sim(tmp_path):
    """A two-node simulated allocation; yields a function starting the job script in it."""
    bin_dir, sim_dir = tmp_path / "bin", tmp_path / "sim"
    (sim_dir / "nodes").mkdir(parents=True)
    bin_dir.mkdir()
    for name, text in (("srun", SRUN_SHIM), ("scontrol", SCONTROL_SHIM)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # Ray sockets live under the temp dir and unix socket paths are short: keep it out of pytest's long tmp path.
    ray_tmp = tempfile.mkdtemp(prefix="mrsim", dir="/tmp")
    port = free_port()
    worker_port_base = random.randrange(20000, 29000, 200)  # each raylet its own worker-port range
    for index, node in enumerate(("simnode1", "simnode2")):
        low = worker_port_base + 100 * index
        (sim_dir / "nodes" / f"{node}.env").write_text(
            f'MEGARL_RAY_NODE_ARGS="--dashboard-agent-listen-port {free_port()} --metrics-export-port {free_port()} '
            f'--min-worker-port {low} --max-worker-port {low + 99}"\n'
        )
    config = tmp_path / "tiny_cpu.yaml"
    config.write_text(TINY_CONFIG)
    log_dir = tmp_path / "logs"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SIM_DIR": str(sim_dir),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "simnode[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
        "MEGARL_SLURM_CONFIG": str(config),
        "MEGARL_SLURM_DEVICE": "cpu",
        "MEGARL_SLURM_GPUS_PER_NODE": "2",
        "MEGARL_RAY_HEAD_IP": "127.0.0.1",
        "MEGARL_RAY_PORT": str(port),
        "MEGARL_RAY_TEMP_DIR": ray_tmp,
        "MEGARL_RAY_WAIT_TIMEOUT_S": "150",
        "MEGARL_RAY_STOP_GRACE_S": "10",
        "LOG_DIR": str(log_dir),
        "PYTHON": sys.executable,
    }
    env.pop("RAY_ADDRESS", None)
    markers = [ray_tmp, f"127.0.0.1:{port}", str(log_dir), str(config)]
    started: list[subprocess.Popen] = []

    def start(*args: str, **env_overrides: str) -> subprocess.Popen:
        out = (tmp_path / "job.out").open("w")
        proc = subprocess.Popen(["bash", str(REPO / "slurm" / "grpo_7b.sh"), *args], env={**env, **env_overrides},
                                cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    start.log_dir, start.markers, start.output = log_dir, markers, tmp_path / "job.out"
    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in processes_matching(markers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until_gone(markers, 10)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def wait_or_explain(proc: subprocess.Popen, sim, timeout_s: float) -> int:
    """The job script's exit status; past ``timeout_s`` it is killed and the test fails with what it and the
    Ray nodes printed (a hang is then diagnosable from the CI log alone)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        logs = "".join(f"\n--- {log.name}:\n{log.read_text()[-4000:]}" for log in sorted(sim.log_dir.glob("*.log")))
        pytest.fail(f"the job script did not finish within {timeout_s} s\n--- its output:\n"
                    f"{sim.output.read_text()}{logs}")


@pytest.mark.timeout(300)
def test_dry_run_places_ranks_on_both_nodes(sim):
    proc = sim("--dry-run")
    rc = wait_or_explain(proc, sim, 280)
    print(sim.output.read_text())
    output = sim.output.read_text()
    assert rc == 0, output
    assert "cluster_wait: 2 nodes ready" in output, output
    placement = output.split("placement (2 nodes x 2 cpu processes):", 1)[1]
    rows = [line.split() for line in placement.splitlines()[2:6]]  # header line, then 4 ranks
    assert [row[0] for row in rows] == ["0", "1", "2", "3"], placement
    node_of_rank = {row[0]: row[-1] for row in rows}
    # Each pool node is one STRICT_PACK group: ranks 0-1 share a node, ranks 2-3 the other one.
    assert node_of_rank["0"] == node_of_rank["1"] != node_of_rank["2"] == node_of_rank["3"], placement
    assert set(node_of_rank.values()) == {"simnode1", "simnode2"}
    assert "Ray runtime started" in (sim.log_dir / "simnode1.log").read_text()
    assert "Ray runtime started" in (sim.log_dir / "simnode2.log").read_text()
    assert wait_until_gone(sim.markers, 30) == [], "ray processes left after the job script ended"


@pytest.mark.timeout(240)
def test_workers_wait_for_the_head_and_a_head_that_dies_is_named(sim):
    # An argument `ray start` refuses, on the head's node only: the head exits at once. The workers, which start
    # only once the head has started, never start; the job says which node and which log, long before
    # MEGARL_RAY_WAIT_TIMEOUT_S.
    head_env = sim.log_dir.parent / "sim" / "nodes" / "simnode1.env"
    head_env.write_text(head_env.read_text() + 'MEGARL_RAY_NODE_ARGS="$MEGARL_RAY_NODE_ARGS --no-such-ray-flag"\n')
    proc = sim("--dry-run", MEGARL_RAY_WAIT_TIMEOUT_S="150")
    rc = wait_or_explain(proc, sim, 120)
    output = sim.output.read_text()
    assert rc == 1, output
    assert "ray head on simnode1 exited before it started" in output and "simnode1.log" in output, output
    assert "started ray worker" not in output, output
    assert "no-such-ray-flag" in (sim.log_dir / "simnode1.log").read_text()
    assert wait_until_gone(sim.markers, 30) == []


@pytest.mark.timeout(240)
def test_too_small_cluster_fails_with_what_is_missing(sim):
    # Each node gets 1 CPU but the run wants 2 worker processes per node.
    proc = sim("--dry-run", MEGARL_SLURM_CPUS_PER_NODE="1")
    rc = wait_or_explain(proc, sim, 200)
    output = sim.output.read_text()
    assert rc == 1, output
    assert "the run asks for 2 nodes x 2 CPUs" in output and "has 0 such node(s)" in output, output
    # both nodes of the allocation joined and neither fits: said then, not after MEGARL_RAY_WAIT_TIMEOUT_S
    assert "with all 2 nodes of the allocation joined" in output, output
    assert "simnode1 (" in output and "simnode2 (" in output, output  # the alive nodes are listed
    assert "cluster did not come up" in output
    assert wait_until_gone(sim.markers, 30) == []


def test_scontrol_shim_expands_nodelists(tmp_path):
    shim = tmp_path / "scontrol"
    shim.write_text(SCONTROL_SHIM)
    shim.chmod(0o755)
    out = subprocess.run([str(shim), "show", "hostnames", "gpu[01-03,7],login"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]


def test_multinode_rejects_a_bad_config_before_touching_ray(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(TINY_CONFIG)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "multinode.py"), "--config", str(config),
                           "trainer.n_gpus_per_nod=2", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trainer.n_gpus_per_nod" in proc.stderr


@pytest.mark.parametrize("all_addresses,nodes,expected", [
    ("fd00::2 10.1.2.3 172.17.0.1", 2, "10.1.2.3"),  # /etc/hosts says 127.0.1.1: the interface address wins
    ("", 2, ""),  # only loopback on a multi-node job: no address (the caller names MEGARL_RAY_HEAD_IP)
    ("", 1, "127.0.0.1"),  # one node: loopback is fine
])
def test_head_address_is_never_loopback_on_several_nodes(tmp_path, all_addresses, nodes, expected):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done\n'
                                  'exec "$@"\n')
    (bin_dir / "hostname").write_text(f'#!/bin/bash\n[[ "$1" == --all-ip-addresses ]] && echo "{all_addresses}" '
                                      '&& exit 0\necho 127.0.1.1\n')
    for tool in ("srun", "hostname"):
        (bin_dir / tool).chmod(0o755)
    script = (f"source {REPO / 'slurm' / 'ray_cluster.sh'}; MEGARL_NODES=({' '.join(f'n{i}' for i in range(nodes))});"
              " megarl_head_ip n0")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEGARL_RAY_HEAD_IP": ""})
    assert out.stdout.strip() == expected, out
