"""A resumed conversion refuses a progress record of other inputs or options; peak RSS of a 0.77 GB
conversion stays within the memory budget. (A conversion killed mid-part and resumed:
test_torch_dist.py.)"""

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO


def test_resume_with_different_options_is_refused(tmp_path):
    from megarl.checkpoint_io.execution import ProgressManifest

    ProgressManifest(str(tmp_path), "hash-a")
    with pytest.raises(ValueError, match="different inputs or options"):
        ProgressManifest(str(tmp_path), "hash-b")


BUDGET = 256 * 2**20
SLACK = 48 * 2**20  # python objects of the plan, tqdm, allocator granularity


@pytest.mark.timeout(300)
def test_peak_rss_stays_within_budget_independent_of_model_size(tmp_path):
    from megarl.checkpoint_io.synthetic import write_synthetic_llama_checkpoint

    total = write_synthetic_llama_checkpoint(str(tmp_path / "hf"), hidden_size=512, num_layers=48,
                                             intermediate_size=2048, vocab_size=4096, shard_bytes=200 * 2**20)
    assert total > 700 * 2**20
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-m", "tests.distributed.converters.rss_probe", "hf_to_mcore", str(tmp_path / "hf"),
                            str(tmp_path / "mc"), str(BUDGET)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=280)
    assert probe.returncode == 0, probe.stderr[-3000:]
    numbers = json.loads(probe.stdout.strip().splitlines()[-1])
    used = numbers["peak"] - numbers["baseline"]
    assert used < BUDGET + SLACK, f"conversion used {used / 2**20:.0f} MiB over its baseline"
    assert used < total / 4  # far below holding the model: the bound is real
    from megarl.checkpoint_io.torch_dist_reader import TorchDistReader

    reader = TorchDistReader(str(tmp_path / "mc"))
    assert reader.shape("decoder.layers.mlp.linear_fc1.weight") == (48, 4096, 512)
