"""A worker killed by Ray's memory monitor for the node's memory is reported as out of host memory: the phase,
the rank, the node's numbers and the knobs that hold less on the host; its peers' failures come second and the
group refuses further calls (real Ray, its own cluster with a low memory threshold, in a subprocess)."""

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

# exclusive: Ray's memory monitor watches the whole node, so another test's memory would move the threshold
pytestmark = [pytest.mark.timeout(240), pytest.mark.exclusive]


def test_a_worker_killed_for_host_memory_names_the_phase_and_the_knobs():
    pytest.importorskip("ray")
    run = subprocess.run([sys.executable, "-m", "tests.distributed.controller.host_oom_world", str(REPO)],
                         cwd=REPO, capture_output=True, text=True, timeout=200)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    error = result["error"]
    assert error is not None, result
    assert result["cause"] == "HostOutOfMemory" and result["method"] == "update_actor", error
    assert "out of host memory in actor update (forward, backward, optimizer step) [update_actor]" in error
    assert "running low on memory" in error and "GB used /" in error  # Ray's numbers of the node
    assert "optimizer_offload_fraction" in error and "--host-memory-gib" in error
    assert "broken" in result["after"], result["after"]
