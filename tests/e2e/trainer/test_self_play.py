"""SPPO's recipe (configs/sppo_tiny.yaml) learns the digit task on CPU: the win rate of each response against
its prompt's others as the target of its log-ratio to the previous policy."""

from __future__ import annotations

import pytest

from megarl.run_config import load_config
from tests.e2e.trainer.learning import rose_beyond_noise
from tests.paths import REPO


@pytest.mark.timeout(300)
def test_the_sppo_recipe_learns(tmp_path):
    from megarl.trainer.main import run

    cfg = load_config(REPO / "configs" / "sppo_tiny.yaml", [
        "trainer.backend=inprocess", f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.total_training_steps=20"])
    history = run(cfg)
    scores = [row["critic/score/mean"] for row in history]
    # recorded run, 2026-12-06: 0.04 over the first steps, 0.22-0.26 by steps 20-24
    rose, how = rose_beyond_noise(scores, first=3, last=3, responses_per_step=16 * 8)
    assert rose, how
    assert all(row["actor/pg_clipfrac"] == 0 for row in history)  # SPPO clips nothing: its loss, not PPO's
