"""Debugging a worker as the README says: a real run (its own Ray cluster, in a subprocess) with
``MEGARL_RAY_DEBUG=debugpy`` and ``MEGARL_BREAK_AT=update_actor:0`` stops rank 0 before its update; a real DAP
client (what VS Code speaks) attaches to the port the worker prints, reads the stopped frame's locals, holds the
rank longer than ``trainer.worker_timeout_s`` (the call's watchdog must wait, not kill it), and continues; the run
then finishes its step and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.paths import REPO

pytest.importorskip("debugpy")

WORKER_TIMEOUT_S = 20
LISTENING = re.compile(r"Ray debugger is listening on ([\d.]+):(\d+)")


@pytest.mark.timeout(400)
def test_a_dap_client_stops_a_worker_at_its_update_reads_a_local_and_the_run_finishes(tmp_path):
    from tests.dap_client import DapClient

    env = {**os.environ, "MEGARL_RAY_DEBUG": "debugpy", "MEGARL_BREAK_AT": "update_actor:0",
           "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_DEBUG", None)
    command = [sys.executable, "-m", "megarl.trainer.main", "--config", "configs/grpo_tiny.yaml",
               "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
               "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=['jsonl']",
               f"trainer.worker_timeout_s={WORKER_TIMEOUT_S}", f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(LISTENING.search(line) for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.2)
        host, port = next(LISTENING.search(line) for line in lines if LISTENING.search(line)).groups()
        client = DapClient(host, int(port))
        stopped = client.attach()
        paused_at = time.monotonic()
        frames = client.frames(stopped["threadId"])
        top = frames[0]
        assert top["name"] == "execute" and top["source"]["path"].endswith("megarl/controller/worker_group.py"), frames
        local = client.locals_of(top["id"])
        assert local["method_name"] == "'update_actor'" and local["self"] == "actor_rollout_ref[rank 0]", local
        assert local["args"].startswith("(TrainBatch(prompt_ids=tensor("), local  # the batch the update gets
        time.sleep(max(0.0, WORKER_TIMEOUT_S + 4 - (time.monotonic() - paused_at)))  # past the call's deadline
        client.request("continue", threadId=stopped["threadId"])
        client.close()
        assert proc.wait(timeout=240) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    output = "".join(lines)
    assert "worker debugging on (RAY_DEBUG=1); Ray dashboard: " in output
    assert "actor_rollout_ref.update_actor(): rank(s) [0] sit at a debugger breakpoint" in output, output[-4000:]
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 1') == 1
