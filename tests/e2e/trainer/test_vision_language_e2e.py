"""Vision-language GRPO end to end on CPU through real Ray: the embedded tiny Qwen2.5-VL learns on generated
pictures (megarl.data.shapes_task: how many shapes), each prompt's image going from the parquet file through the
dataset's pixels to the HF rollout engine and the Megatron actor. The rollout engine's log-probs of what it sampled
equal the trainer's recomputation every step: an image that reached one of them and not the other, or reached them
as different pixels or positions, would move every log-prob after it by far more."""

from __future__ import annotations

import pytest

from megarl.run_config import load_config
from tests.e2e.trainer.learning import rose_beyond_noise
from tests.paths import REPO

RESPONSES_PER_STEP = 16 * 8  # grpo_vl_tiny's data.train_batch_size x rollout.n


def _config(tmp_path, *overrides: str):
    return load_config(REPO / "configs" / "grpo_vl_tiny.yaml", [
        f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.save_freq=-1", *overrides])


@pytest.mark.timeout(600)
def test_vision_language_grpo_learns_on_the_pictures_with_the_rollouts_log_probs(tmp_path):
    from megarl.trainer.main import run

    history = run(_config(tmp_path, "trainer.total_training_steps=12", "trainer.test_freq=12"))
    for h in history:
        # fp32 both sides: the same images, positions and weights give the same log-probs
        assert h["rollout/log_prob_diff_max"] < 1e-4, (h["step"], h["rollout/log_prob_diff_max"])
        # the chat template and question (84 tokens) and the picture: 64 px -> 56 px, 4 x 4 patches merged 2 x 2
        # -> 4 image tokens, and the two around them
        assert h["prompt_length/mean"] == 84 + 6, h["prompt_length/mean"]
    scores = [h["critic/score/mean"] for h in history]
    rose, how = rose_beyond_noise(scores, first=3, last=3, responses_per_step=RESPONSES_PER_STEP)
    assert rose, f"mean reward did not rise: {how}"
    assert history[-1]["val/synthetic/shapes/score/mean"] >= 0


@pytest.mark.timeout(600)
def test_conversations_one_step_off_see_the_prompts_picture_on_every_turn(tmp_path):
    """Multi-turn rollouts (the calculator forced on every turn, as in test_agent_e2e.py) generated one step off
    on a separate rollout worker: each turn's prompt is the conversation so far, its image tokens still the
    prompt's, so the engine takes the picture again at every turn (an image token an earlier turn sampled stays
    text). Step 1's batch was generated with the initial weights, which the actor scores it with: the trainer's
    log-probs of every generated token equal the engine's; step 2's came one update behind."""
    from megarl.trainer.main import run
    from tests.e2e.trainer.test_agent_e2e import MULTI_TURN

    history = run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1", *MULTI_TURN,
                          "async_training.mode=one_step_off", "trainer.placement=separate",
                          "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1"))
    assert all(h["agent/tool_calls/mean"] > 0.5 and h["agent/turns/mean"] > 1 for h in history), history
    assert history[0]["rollout/log_prob_diff_max"] < 1e-4, history[0]["rollout/log_prob_diff_max"]
    assert history[1]["rollout/log_prob_diff_max"] > 1e-4


@pytest.mark.timeout(600)
def test_fully_async_partial_rollouts_carry_the_picture_and_a_critic_values_it(tmp_path):
    """fully_async with two-token chunks: every response is generated over several calls, each one sending the
    prompt and the tokens so far, and the prompt's picture again (a continuation without it would score every later
    token differently). Step 1's groups came from the initial weights: the trainer's log-probs equal the engine's.
    GAE's critic is the same vision-language trunk with a value head, fed the same images."""
    from megarl.trainer.main import run

    history = run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                          "trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
                          "async_training.mode=fully_async", "async_training.partial_rollout_chunk=2",
                          "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4"))
    first = history[0]
    assert first["async/staleness_max"] == 0.0 and first["response_length/mean"] > 2  # most took two calls
    assert first["rollout/log_prob_diff_max"] < 1e-4, first["rollout/log_prob_diff_max"]
    assert all(h["prompt_length/mean"] == 84 + 6 for h in history)
    assert all(0 < h["critic/vf_loss"] < float("inf") for h in history), [h["critic/vf_loss"] for h in history]
