"""Reward of the multi-turn GRPO test: the digit task's score of the conversation's final answer.

It checks what a reward function is given of a conversation: the whole response (every turn and every tool
result, which must be in ``solution_str``) and ``extra_info["agent"]`` (turns, calls, final text)."""

from megarl.rewards.synthetic_task import score_digits


def compute_score(data_source, solution_str, ground_truth, extra_info):
    agent = extra_info["agent"]
    for call in agent["calls"]:
        if call["result"] not in solution_str:
            raise AssertionError(f"tool result {call['result']!r} is not in the response {solution_str!r}")
    return {"score": score_digits(agent["final_text"], ground_truth), "turns": float(agent["turns"])}
