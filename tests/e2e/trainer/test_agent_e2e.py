"""Multi-turn GRPO on CPU: every response a conversation with the calculator between turns (the tiny random
policy's calls forced by tests/distributed/agents/forced_calls.py), tool results masked out of the loss, the final
answer scored; real Ray workers, Megatron actor, HF rollout engine."""

import pytest

from megarl.run_config import load_config
from tests.e2e.trainer.learning import rose_beyond_noise
from tests.paths import REPO


MULTI_TURN = (
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={REPO}/configs/tools/calculator_python.yaml",
    "actor_rollout_ref.rollout.multi_turn.format=tests.distributed.agents.forced_calls.CalculatorEveryTurn",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=4",
    # a turn of 4 + a tool turn of <= 23 tokens (22 + the end-of-turn a cut turn lacks) + a turn of 4
    "data.max_response_length=31",
    f"reward_model.custom_function.path={REPO}/tests/distributed/agents/final_answer_reward.py",
)


RESPONSES_PER_STEP = 16 * 8  # grpo_tiny's data.train_batch_size x rollout.n


def _config(tmp_path, *overrides):
    return load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.save_freq=-1", *MULTI_TURN, *overrides])


@pytest.mark.timeout(900)
def test_multi_turn_grpo_trains_on_the_generated_tokens_and_scores_the_final_answer(tmp_path):
    from megarl.trainer.main import run

    history = run(_config(tmp_path, "trainer.total_training_steps=20", "trainer.test_freq=20"))
    scores = [h["critic/score/mean"] for h in history]
    print("turns", [round(h["agent/turns/mean"], 2) for h in history])
    rose, how = rose_beyond_noise(scores, first=5, last=5, responses_per_step=RESPONSES_PER_STEP)
    assert rose, f"mean reward did not rise: {how}"
    for h in history[:5]:  # a random policy's turns are read as calls: tool turns are in the responses ...
        assert h["agent/tool_calls/mean"] > 0.5 and 0 < h["agent/generated_token_fraction"] < 1
    for h in history:
        assert 1 <= h["agent/turns/mean"] <= 2
        # ... and out of the policy's statistics: the trainer's log-probs of the generated tokens equal the
        # rollout engine's (a tool token counted here would differ by its whole log-prob, not by 1e-4)
        assert h["rollout/log_prob_diff_max"] < 1e-3, (h["step"], h["rollout/log_prob_diff_max"])
        # ... and out of the loss: the tokens the actor's loss counted are the generated ones, not the responses'
        generated = h["agent/generated_token_fraction"] * h["response_length/mean"] * RESPONSES_PER_STEP
        assert abs(h["actor/loss_tokens"] - generated) < 0.5, (h["step"], h["actor/loss_tokens"], generated)
    assert history[-1]["val/score/mean"] >= 0 and "agent/turns/mean" in history[-1]


# The final-answer reward, sending the driver SIGTERM (a scheduler's stop) while it scores sample STOP.
STOPPING_REWARD = """
import os, signal
from tests.distributed.agents.final_answer_reward import compute_score as score
calls = 0


def compute_score(*args):
    global calls
    calls += 1
    if calls == {stop}:
        os.kill(os.getpid(), signal.SIGTERM)
    return score(*args)
"""


@pytest.mark.timeout(900)
def test_multi_turn_one_step_off_checkpoints_the_conversations_in_flight_and_resumes(tmp_path):
    """Conversations generated on a separate rollout worker while the actor trains (one step off); the batch
    in flight when a SIGTERM stops the run (token masks and conversation summaries included) is checkpointed,
    and the resumed run continues exactly as the uninterrupted one."""
    from megarl.trainer.main import run

    def config(out, stop):
        reward = tmp_path / f"reward_{stop}.py"
        reward.write_text(STOPPING_REWARD.format(stop=stop))
        # the resume scores through another file (one that sends no signal): a change it must be allowed
        return _config(out, "trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
                       "async_training.mode=one_step_off", "trainer.test_freq=-1", "trainer.total_training_steps=3",
                       "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       f"reward_model.custom_function.path={reward}", "trainer.resume_allow_changes=true")

    straight = run(config(tmp_path / "straight", -1))
    assert [h["rollout/weight_lag"] for h in straight] == [0.0, 1.0, 1.0]
    stopped = run(config(tmp_path / "stopped", 8 * 8 + 1))  # while scoring step 2
    assert [h["step"] for h in stopped] == [1, 2]
    assert (tmp_path / "stopped" / "checkpoints" / "global_step_2" / "in_flight_rollout.pt").is_file()
    resumed = run(config(tmp_path / "stopped", -1))
    assert [h["step"] for h in resumed] == [3]
    for want, got in zip(straight[2:], resumed):
        for key in ("critic/score/mean", "agent/turns/mean", "agent/tool_calls/mean", "actor/pg_loss",
                    "rollout/log_prob_diff_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
