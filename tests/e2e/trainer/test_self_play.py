"""The self-play recipes learn the digit task on CPU: SPPO (configs/sppo_tiny.yaml: each response's win rate
against its prompt's others as the target of its log-ratio to the previous policy) and SPIN
(configs/spin_tiny.yaml: online DPO pairs against a reference refreshed from the actor)."""

from __future__ import annotations

import pytest

from megarl.run_config import load_config
from tests.e2e.trainer.learning import rose_beyond_noise
from tests.paths import REPO


def _run_recipe(recipe: str, tmp_path) -> list[dict]:
    """20 steps of ``configs/<recipe>`` in this process, no validation or checkpoints."""
    from megarl.trainer.main import run

    return run(load_config(REPO / "configs" / recipe, [
        "trainer.backend=inprocess", f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.total_training_steps=20"]))


@pytest.mark.timeout(300)
def test_the_sppo_recipe_learns(tmp_path):
    history = _run_recipe("sppo_tiny.yaml", tmp_path)
    scores = [row["critic/score/mean"] for row in history]
    # recorded run, 2026-12-06: 0.04 over the first steps, 0.22-0.26 by steps 20-24
    rose, how = rose_beyond_noise(scores, first=3, last=3, responses_per_step=16 * 8)
    assert rose, how
    assert all(row["actor/pg_clipfrac"] == 0 for row in history)  # SPPO clips nothing: its loss, not PPO's


@pytest.mark.timeout(300)
def test_the_spin_recipe_learns_and_refreshes_its_reference(tmp_path):
    """SPIN (configs/spin_tiny.yaml): each prompt's best and worst response as a DPO pair against the reference,
    which becomes the actor every 10 steps. The whole rollout's mean score (the reward manager's, before the
    pairs are picked) rises."""
    history = _run_recipe("spin_tiny.yaml", tmp_path)
    scores = [row["reward/mean_score"] for row in history]
    # recorded run, 2026-12-06 (paired-batch means): 0.06 over the first steps, 0.2-0.29 from step 10 on
    rose, how = rose_beyond_noise(scores, first=3, last=3, responses_per_step=16 * 8)
    assert rose, how
    assert [row["step"] for row in history if row.get("actor/reference_updated")] == [10, 20]
    assert all(row["perf/tokens"] > 0 for row in history)
