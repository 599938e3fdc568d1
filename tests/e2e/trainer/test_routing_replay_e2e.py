"""MoE GRPO through the trainer with routing replay, on CPU: the embedded tiny Qwen3-MoE, the HF rollout engine in
bfloat16 returning its routed experts, the fp32 Megatron trainer. bf16 rollout routers choose other experts than
the fp32 trainer's for some tokens (the mismatch R3 exists for); with R3 the trainer replays the rollout's
routing, so its log-probs of the rollout's tokens come closer to the rollout's own than when it routes itself.
The first step of both runs generates the same responses from the same weights: the comparison is exact there.
R2 records the old-log-prob pass's routing and replays it in the update."""

from __future__ import annotations

import pytest

from megarl.run_config import load_config
from tests.paths import REPO


def _run(tmp_path, mode: str, steps: int = 2) -> list[dict]:
    from megarl.trainer.main import run

    return run(load_config(REPO / "configs" / "grpo_tiny.yaml", [
        "actor_rollout_ref.model.path=embedded:tiny-qwen3-moe", "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        f"actor_rollout_ref.actor.megatron.router_replay.mode={mode}",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.backend=inprocess", f"trainer.default_local_dir={tmp_path / mode}", "trainer.progress_bar=false",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}"]))


@pytest.mark.timeout(400)
def test_r3_brings_the_trainer_to_the_rollouts_routing_and_log_probs(tmp_path):
    off, r3, r2 = (_run(tmp_path, mode) for mode in ("disabled", "R3", "R2"))
    first_off, first_r3 = off[0], r3[0]
    # same weights, same samples at step 1: the same tokens routed differently by bf16 rollout and fp32 trainer
    assert first_off["routing/rollout_mismatch_frac"] == first_r3["routing/rollout_mismatch_frac"] > 0
    assert first_r3["rollout/log_prob_diff_max"] < first_off["rollout/log_prob_diff_max"]
    assert first_r3["rollout/log_prob_diff_mean"] < first_off["rollout/log_prob_diff_mean"]
    for history in (off, r3, r2):
        assert all(row["actor/grad_norm"] > 0 for row in history)
    assert r2[0]["routing/rollout_mismatch_frac"] == first_off["routing/rollout_mismatch_frac"]
