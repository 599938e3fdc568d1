"""``python -m megarl.doctor`` as a user runs it: the environment read against the tested ranges, then two training
steps of the embedded tiny model in the process (HF engine here), the second checking the weight sync; exit 0."""

import subprocess
import sys

import pytest

from tests.paths import REPO


@pytest.mark.timeout(300)
def test_the_doctor_reads_the_environment_and_runs_a_step():
    proc = subprocess.run([sys.executable, "-m", "megarl.doctor"], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for name in ("python", "torch", "megatron-core", "transformers", "vllm", "ray", "host memory", "/dev/shm"):
        assert any(line.startswith("  [") and f"] {name}:" in line for line in lines), (name, proc.stdout)
    smoke = [line for line in lines if "smoke step (hf)" in line]
    assert smoke and smoke[0].startswith("  [ok"), proc.stdout
    assert "0 failed" in lines[-1]
