"""Checks of conversations a real rollout engine generated through the agent loop (HF engine:
tests/distributed/agents/test_agent_rollout.py; vLLM: tests/distributed/engines/rollout/test_vllm_engine.py)."""

from __future__ import annotations

import torch

from megarl.agents.loop import AgentLoop, AgentSettings
from megarl.agents.tools import load_tools
from megarl.engines.rollout.base import SamplingConfig
from megarl.trainer.agent_rollout import AgentRollout
from tests.distributed.agents.forced_calls import CalculatorEveryTurn, expected_result
from tests.distributed.engines.rollout.reference_decoding import score_response

TOOL_TURN = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"  # the local ChatML template's
QUESTIONS = ["what is two plus three?", "count to four", "name a prime"]


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for index in range(1, len(mask) + 1):
        if index == len(mask) or mask[index] != mask[start]:
            out.append((mask[start], start, index))
            start = index
    return out


def generate_and_check(engine, model, chat_tokenizer, tools_file, *, atol: float) -> list:
    """Conversations of ``engine`` (prompts and tool turns in ``chat_tokenizer``'s ChatML) checked token by
    token: every tool turn holds the calculator's answer to the turn before it, and every generated token's
    rollout log-prob equals ``model``'s teacher-forced log-prob over the whole sequence up to it (so each
    later turn was generated after the tool result, as the sequence says)."""
    settings = AgentSettings(max_response_length=120, max_assistant_turns=3, max_tokens_per_turn=6)
    loop = AgentLoop(chat_tokenizer, load_tools(tools_file), CalculatorEveryTurn(), settings)
    rollout = AgentRollout(engine, loop)
    prompts = [chat_tokenizer.encode(chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        for q in QUESTIONS]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=120, seed=11, logprobs=True,
                              stop_token_ids=(chat_tokenizer.eos_token_id,))
    try:
        outputs = rollout.generate(prompts, sampling)
    finally:
        rollout.close()
    assert [o.prompt_index for o in outputs] == [0, 0, 1, 1, 2, 2]
    for output in outputs:
        segments = runs(output.loss_mask)
        generated = [(s, e) for value, s, e in segments if value == 1]
        context = [(s, e) for value, s, e in segments if value == 0]
        summary = output.agent
        assert summary["turns"] == len(generated) and summary["tool_calls"] == len(context) >= 1
        for (g_start, g_end), (c_start, c_end), call in zip(generated, context, summary["calls"]):
            turn_text = chat_tokenizer.decode(output.token_ids[g_start:g_end], skip_special_tokens=True)
            tool_turn = chat_tokenizer.decode(output.token_ids[c_start:c_end])
            assert call["result"] == expected_result(turn_text)
            assert tool_turn.endswith(TOOL_TURN.format(call["result"])), (turn_text, tool_turn)
        want = score_response(model, prompts[output.prompt_index], output.token_ids)
        mask = torch.tensor(output.loss_mask).bool()
        torch.testing.assert_close(torch.tensor(output.log_probs)[mask], torch.tensor(want)[mask], atol=atol, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(output.log_probs, output.loss_mask) if not m)
    assert max(o.agent["turns"] for o in outputs) >= 2
    return outputs
