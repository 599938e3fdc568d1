"""The README's manual recipe: `ray start --head` and `ray start --address` run by hand, each in a directory of
its own, with Ray 2.60's token authentication on (RAY_AUTH_MODE=token), then `launch/multinode.py` from a third
directory with the default relative `trainer.default_local_dir`.

Real Ray, two nodes on this host (each with its own ports), the tiny model on CPU with TP=2 over 2 x 2 worker
processes. The checkpoint must land complete under the driver's directory (paths resolve once, on the driver),
nothing under the directories the nodes were started in.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from tests.e2e.launch.test_slurm_sim import TINY_CONFIG, processes_matching, wait_until_gone
from tests.paths import REPO


def ray_start(cwd: Path, env: dict, *args: str) -> None:
    proc = subprocess.run(["ray", "start", "--disable-usage-stats", "--num-cpus", "2", "--num-gpus", "0",
                           "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port",
                           str(free_port()), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(400)
def test_hand_started_two_node_cluster_with_token_auth_trains_and_checkpoints_on_the_driver(tmp_path):
    head_dir, worker_dir, driver_dir = (tmp_path / name for name in ("head", "worker", "driver"))
    for folder in (head_dir, worker_dir, driver_dir):
        folder.mkdir()
    (driver_dir / "tiny.yaml").write_text(TINY_CONFIG.replace("experiment_name: slurm_sim", "experiment_name: manual"))
    token = tmp_path / "ray_token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    ray_tmp = tempfile.mkdtemp(prefix="mrman", dir="/tmp")  # unix socket paths must stay short
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    worker_ports = 23000 + 1000 * (port % 7)
    try:
        ray_start(head_dir, env, "--head", "--port", str(port), "--temp-dir", ray_tmp, "--include-dashboard", "false",
                  "--ray-client-server-port", str(free_port()), "--min-worker-port", str(worker_ports),
                  "--max-worker-port", str(worker_ports + 499))
        ray_start(worker_dir, env, "--address", f"127.0.0.1:{port}", "--min-worker-port", str(worker_ports + 500),
                  "--max-worker-port", str(worker_ports + 999))
        driver = subprocess.run(
            [sys.executable, str(REPO / "launch" / "multinode.py"), "--config", "tiny.yaml", "--address",
             f"127.0.0.1:{port}", "trainer.total_training_steps=1", "trainer.save_freq=1"],
            cwd=driver_dir, env=env, capture_output=True, text=True, timeout=300)
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
        checkpoint = driver_dir / "outputs" / "megarl" / "manual" / "checkpoints" / "global_step_1"
        assert (checkpoint / "trainer_state.json").is_file(), driver.stdout[-2000:]
        assert any((checkpoint / "actor").rglob("*")), "the actor's shards are not in the committed checkpoint"
        for node_dir in (head_dir, worker_dir):
            assert list(node_dir.iterdir()) == [], f"files written where a Ray node was started: {node_dir}"
        # no trainer.ray_address, the cluster known from the environment (as after `ray start` on this machine):
        # the driver attaches to it, where Ray alone refuses ("num_cpus ... must not be provided")
        plain = subprocess.run(
            [sys.executable, "-m", "megarl.trainer.main", "--config", str(driver_dir / "tiny.yaml"),
             "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'plain'}", "trainer.nnodes=1",
             "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
            cwd=REPO, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
        assert re.search(rf"a Ray cluster runs here \([\d.]+:{port}, .*\): attaching to it", plain.stdout), plain.stdout
    finally:
        markers = [ray_tmp, f":{port}"]
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            for pid in processes_matching(markers):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if not wait_until_gone(markers, grace):
                break
        shutil.rmtree(ray_tmp, ignore_errors=True)
