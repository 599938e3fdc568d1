"""A SIGKILLed driver leaves no process behind (real Ray, the trainer in a subprocess)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.controller.orphan_reaper import _start_time, descendants
from tests.paths import REPO


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_nothing_outlives_a_sigkilled_driver(tmp_path):
    command = [sys.executable, "-m", "megarl.trainer.main", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
               "trainer.total_training_steps=500", "trainer.save_freq=-1", "trainer.test_freq=-1",
               "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=['jsonl']",
               f"trainer.default_local_dir={tmp_path}"]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    run_processes = descendants(driver.pid)  # Ray's GCS, raylet, agents, the workers
    assert len(run_processes) >= 4, run_processes
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 20
    while True:
        alive = [pid for pid, start in run_processes if _start_time(pid) == start]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in alive if Path(f"/proc/{pid}").exists()}
    assert not alive, f"still running 20 s after the driver's SIGKILL: {names}"
