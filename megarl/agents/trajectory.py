"""A multi-turn trajectory as one sequence, and the token accounting that makes it trainable.

The trajectory is the prompt followed by one *response*: every assistant turn the model generated (loss mask 1,
with the rollout engine's log-probs) and, between turns, the *context* the chat template writes around the tool
results (loss mask 0, log-prob 0): the end of the model's turn it did not generate, the ``tool`` messages and
the next assistant header. The response budget (``data.max_response_length``) counts all of it, every turn;
what does not fit is cut and the trajectory ends with ``finish_reason="length"``.

:func:`context_tokens` renders that context with the tokenizer's own chat template, as the difference between
the conversation rendered before and after the new messages, so the tokens the model is trained on are exactly
those a chat template would give the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megarl.batch import UNKNOWN_EXPERT


@dataclass
class Trajectory:
    prompt_ids: list[int]
    max_response_length: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the model generated
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0  # assistant turns generated
    finish_reason: Optional[str] = None  # stop (no tool call) | length (budget) | max_turns
    # MoE (routing replay): the rollout engine's expert ids [positions, L_moe, K] of prompt + response from
    # position 0, -1 where unknown; each turn's request routes the whole sequence before its last token
    routed_experts: Optional[np.ndarray] = None

    @property
    def budget(self) -> int:
        return self.max_response_length - len(self.response_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_prompt(self) -> list[int]:
        """What the next assistant turn is generated from."""
        return self.prompt_ids + self.response_ids

    def add_generated(self, tokens: list[int], log_probs: Optional[list[float]] = None) -> None:
        kept = tokens[: self.budget]
        self.response_ids += kept
        self.loss_mask += [1] * len(kept)
        self.log_probs += list(log_probs[: len(kept)]) if log_probs is not None else [0.0] * len(kept)
        self.turns += 1
        if len(kept) < len(tokens) or self.budget == 0:
            self.finish_reason = "length"

    def add_routing(self, routed: np.ndarray, start: int) -> None:
        """A turn's routing (positions ``start ...`` of its request): it routed the trajectory so far again (the
        latest weights' routing wins), less a prefix served from the engine's cache, which keeps the earlier
        turns'. Positions past the kept tokens (a turn cut by the budget) are dropped."""
        end = min(start + len(routed), len(self.prompt_ids) + len(self.response_ids) - 1)
        routed = routed[: max(0, end - start)]
        known = 0 if self.routed_experts is None else len(self.routed_experts)
        merged = np.full((max(known, end), *routed.shape[1:]), UNKNOWN_EXPERT, dtype=routed.dtype)
        if known:
            merged[:known] = self.routed_experts
        merged[start:end] = routed
        self.routed_experts = merged

    def add_context(self, tokens: list[int]) -> None:
        """Tool results and chat-template glue: part of the sequence, not of the loss."""
        kept = tokens[: self.budget]
        self.response_ids += kept
        self.loss_mask += [0] * len(kept)
        self.log_probs += [0.0] * len(kept)
        if len(kept) < len(tokens) or self.budget == 0:  # no room left for the model to answer
            self.finish_reason = "length"


def context_tokens(tokenizer, history: list[dict], new_messages: list[dict],
                   tools: Optional[list[dict]] = None) -> list[int]:
    """The tokens between the end of the model's last turn in ``history`` (an assistant message) and its next
    turn: what the template writes after the end-of-turn token the model generated, ``new_messages`` (tool
    results) and the generation prompt. ``tools`` (the function schemas) are passed to the template as the
    prompt was rendered with them."""
    extra = {"tools": tools} if tools else {}
    before = tokenizer.apply_chat_template(history, tokenize=False, **extra)
    after = tokenizer.apply_chat_template(history + new_messages, add_generation_prompt=True, tokenize=False,
                                          **extra)
    if not after.startswith(before):
        raise ValueError("the chat template renders the earlier turns differently once tool messages follow; "
                         "its context cannot be appended token by token")
    eos = tokenizer.eos_token or ""
    # the model's turn as generated ends at its end-of-turn token; the template may write more (Qwen: "\n")
    tail = before[before.rindex(eos) + len(eos):] if eos and eos in before else ""
    return tokenizer.encode(tail + after[len(before):], add_special_tokens=False)
