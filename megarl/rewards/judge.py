"""An LLM judge's plumbing: judging prompts in, scores out (the generation itself is the rollout engine's).

``JudgePrompts.build`` fills ``reward_model.judge.prompt_template`` with each sample's question (the dataset
prompt's last user message, or its text), the decoded response and the reference (the ground truth), and
renders it as one user turn with the policy tokenizer's chat template (plain text without one). Judging
prompts longer than ``max_prompt_tokens`` lose tokens from their start. ``parse_judgements`` reads the first
match of ``score_pattern``'s first group as a number times ``score_scale``; a judgement without one scores
0 and is counted (``on_unparsable=zero``) or fails the step naming the sample (``fail``).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch


class JudgeError(RuntimeError):
    """A judgement had no score in it (with ``reward_model.judge.on_unparsable=fail``)."""


def question_of(raw_prompt: Any) -> str:
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
    return users[-1] if users else raw_prompt[-1]["content"]


def judge_prompt_ids(tokenizer, template: str, *, questions: Sequence[str], responses: Sequence[str],
                     references: Sequence[Any], max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids of each judging prompt, and how many were cut to ``max_prompt_tokens``."""
    prompts, cut = [], 0
    for question, response, reference in zip(questions, responses, references):
        text = template.format(question=question, response=response, reference="" if reference is None else reference)
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_prompt_tokens:
            ids, cut = ids[-max_prompt_tokens:], cut + 1
        prompts.append(ids)
    return prompts, cut


def parse_judgements(judgements: Sequence[str], *, pattern: str, scale: float, on_unparsable: str
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores ``[B]`` and metrics (``reward/judge/unparsable``)."""
    compiled = re.compile(pattern)
    scores: list[float] = []
    unparsable = 0
    for index, text in enumerate(judgements):
        value: Optional[float] = None
        match = compiled.search(text)
        if match is not None:
            try:
                value = float(match.group(1))
            except (TypeError, ValueError):
                value = None
        if value is None:
            if on_unparsable == "fail":
                raise JudgeError(f"judgement {index} has no score matching reward_model.judge.score_pattern="
                                 f"{pattern!r}: {text[:200]!r}")
            unparsable += 1
            value = 0.0
        scores.append(value * scale)
    return torch.tensor(scores, dtype=torch.float32), {"reward/judge/unparsable": float(unparsable)}
