"""Token accounting of multi-turn trajectories on crafted sequences: exact masks, log-probs and budget cuts."""

import pytest
from transformers import AutoTokenizer

from megarl.agents.trajectory import Trajectory, context_tokens
from megarl.data.tokenizer import write_local_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(write_local_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_generated_tokens_train_and_context_does_not():
    trajectory = Trajectory(prompt_ids=[5, 6, 7], max_response_length=12)
    trajectory.add_generated([10, 11, 12], [-0.1, -0.2, -0.3])
    trajectory.add_context([20, 21])
    trajectory.add_generated([13, 14], [-0.4, -0.5])
    assert trajectory.response_ids == [10, 11, 12, 20, 21, 13, 14]
    assert trajectory.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert trajectory.log_probs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert trajectory.next_prompt() == [5, 6, 7, 10, 11, 12, 20, 21, 13, 14]
    assert trajectory.turns == 2 and trajectory.budget == 5 and not trajectory.finished


def test_the_budget_counts_every_turn_and_cuts_what_does_not_fit():
    trajectory = Trajectory(prompt_ids=[1], max_response_length=6)
    trajectory.add_generated([10, 11], [-1.0, -1.0])
    trajectory.add_context([20, 21, 22])
    trajectory.add_generated([12, 13, 14], [-2.0, -2.0, -2.0])  # one token of room left
    assert trajectory.response_ids == [10, 11, 20, 21, 22, 12] and trajectory.loss_mask == [1, 1, 0, 0, 0, 1]
    assert trajectory.log_probs[-1] == -2.0 and trajectory.finish_reason == "length"
    full = Trajectory(prompt_ids=[1], max_response_length=4)
    full.add_generated([10, 11])
    full.add_context([20, 21, 22])  # tool output that does not fit: nothing left for an answer
    assert full.response_ids == [10, 11, 20, 21] and full.loss_mask == [1, 1, 0, 0] and full.finish_reason == "length"


def test_context_is_what_the_chat_template_writes_between_turns(tokenizer):
    history = [{"role": "user", "content": "what is 2+3?"},
               {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'}]
    tool = [{"role": "tool", "content": "5"}]
    ids = context_tokens(tokenizer, history, tool)
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # the whole conversation, rendered at once, is the prompt + generated turn + this context
    prompt = tokenizer.apply_chat_template(history[:1], add_generation_prompt=True, tokenize=False)
    generated = history[1]["content"] + tokenizer.eos_token
    whole = tokenizer.apply_chat_template(history + tool, add_generation_prompt=True, tokenize=False)
    assert prompt + generated + tokenizer.decode(ids) == whole


def _routing(positions: int, value: int):
    import numpy as np

    return np.full((positions, 2, 2), value, dtype=np.int16)


def test_each_turns_routing_covers_the_sequence_before_its_last_token_and_a_cached_prefix_keeps_the_earlier():
    trajectory = Trajectory(prompt_ids=[5, 6, 7], max_response_length=8)
    trajectory.add_generated([10, 11])
    trajectory.add_routing(_routing(3 + 2 - 1, 1), start=0)  # prompt + first turn less its last token
    trajectory.add_context([20])
    trajectory.add_generated([12, 13, 14, 15, 16])  # the budget keeps 5 of 5
    # the second request routed from position 2 on (positions 0-1 came from the prefix cache), and one token
    # further than what was kept would reach (a longer turn cut by the budget)
    trajectory.add_routing(_routing(3 + 2 + 1 + 5 - 1 - 2 + 1, 2), start=2)
    routed = trajectory.routed_experts
    assert routed.shape == (10, 2, 2)  # the 11 tokens less the last
    assert (routed[:2] == 1).all() and (routed[2:] == 2).all()
