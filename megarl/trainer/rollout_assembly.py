"""Turn sampled token ids into a fixed-width :class:`RolloutBatch`, and decode its rows to text.

Rows are padded to the configured ``max_prompt_length`` / ``max_response_length`` (not to the batch
maximum) so that batches from different ranks and steps concatenate without re-padding. Scoring is
:mod:`megarl.trainer.scoring`'s. Pure functions: no Ray, no engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megarl.batch import UNKNOWN_EXPERT, RolloutBatch
from megarl.data.dataset import PromptBatch


@dataclass(frozen=True)
class RowWidths:
    """The fixed widths every rollout batch is padded to (``data.max_prompt_length`` /
    ``max_response_length``) and the pad token."""

    max_prompt_length: int
    max_response_length: int
    pad_token_id: int


def assemble_rollout_batch(prompts: PromptBatch, responses: Sequence, *, group_ids: Sequence[str],
                           widths: RowWidths) -> RolloutBatch:
    """One row per response, in order. Each response is a
    :class:`~megarl.engines.rollout.base.RolloutOutput` (``token_ids``, ``prompt_index`` into ``prompts``,
    ``log_probs``); multi-turn ones (:class:`~megarl.trainer.agent_rollout.AgentOutput`) also bring
    ``loss_mask`` (1 on the tokens the model generated) and ``agent`` (merged into their prompt's
    ``extra_info``: what the reward function sees of the conversation). ``group_ids``: one per prompt."""
    rows = len(responses)
    max_prompt, max_response = widths.max_prompt_length, widths.max_response_length
    prompt_ids = torch.full((rows, max_prompt), widths.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, max_prompt), dtype=torch.long)
    response_ids = torch.full((rows, max_response), widths.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_response), dtype=torch.long)
    with_log_probs = rows > 0 and all(out.log_probs is not None for out in responses)
    log_probs = torch.zeros((rows, max_response)) if with_log_probs else None
    multi_turn = rows > 0 and getattr(responses[0], "loss_mask", None) is not None
    generated = torch.zeros((rows, max_response), dtype=torch.long) if multi_turn else None
    routed = _routed_experts_layout(responses, max_prompt + max_response)
    prompt_index = [out.prompt_index for out in responses]
    for row, (which, out) in enumerate(zip(prompt_index, responses)):
        prompt, response = prompts.prompt_ids[which], out.token_ids
        if len(prompt) > max_prompt:
            raise ValueError(f"prompt {which} has {len(prompt)} tokens > data.max_prompt_length={max_prompt}")
        if len(response) > max_response:
            raise ValueError(f"response {row} has {len(response)} tokens > data.max_response_length={max_response}")
        if prompt:
            prompt_ids[row, -len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            prompt_mask[row, -len(prompt):] = 1
        if response:
            response_ids[row, : len(response)] = torch.as_tensor(response, dtype=torch.long)
            response_mask[row, : len(response)] = 1
            if log_probs is not None:
                log_probs[row, : len(response)] = torch.as_tensor(out.log_probs, dtype=torch.float32)
            if generated is not None:
                generated[row, : len(response)] = torch.as_tensor(out.loss_mask, dtype=torch.long)
        if routed is not None:
            # the engine's positions count from the prompt's first token, which sits at max_prompt - len(prompt)
            first = max_prompt - len(prompt) + out.routed_experts_start
            if first + len(out.routed_experts) > max_prompt + len(response) - 1:
                raise ValueError(f"response {row}: the engine routed {len(out.routed_experts)} tokens from position "
                                 f"{out.routed_experts_start} of a {len(prompt)} + {len(response)} token sequence")
            routed[row, first:first + len(out.routed_experts)] = torch.from_numpy(out.routed_experts)

    def per_row(values: Sequence) -> list:
        return [values[i] for i in prompt_index] if len(values) else []

    extra_infos = per_row(prompts.extra_infos)
    if multi_turn:
        base = extra_infos or [{}] * rows
        extra_infos = [{**(info or {}), "agent": out.agent} for info, out in zip(base, responses)]

    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        group_ids=[group_ids[i] for i in prompt_index], data_sources=per_row(prompts.data_sources),
        ground_truths=per_row(prompts.ground_truths), extra_infos=extra_infos, rollout_log_probs=log_probs,
        raw_prompts=per_row(prompts.raw_prompts), generated_mask=generated, routed_experts=routed,
        multi_modal_inputs=per_row(prompts.multi_modal_inputs) or None,
    )


def _routed_experts_layout(responses: Sequence, width: int):
    """``[rows, width, L_moe, K]`` int16 of ``UNKNOWN_EXPERT`` when the engine returned routing (every response or
    none)."""
    given = [getattr(out, "routed_experts", None) is not None for out in responses]
    if not any(given):
        return None
    if not all(given):
        raise ValueError(f"{given.count(False)} of {len(responses)} responses came without routed experts")
    _, layers, top_k = responses[0].routed_experts.shape
    return torch.full((len(responses), width, layers, top_k), UNKNOWN_EXPERT, dtype=torch.int16)


def prompts_of_rows(batch: RolloutBatch, rows: Sequence[int]) -> PromptBatch:
    """The prompts of ``batch``'s ``rows`` (unpadded), with their reward-side fields."""

    def picked(values: Sequence) -> list:
        return [values[r] for r in rows] if len(values) else []

    return PromptBatch(prompt_ids=[batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() for r in rows],
                       raw_prompts=picked(batch.raw_prompts), ground_truths=picked(batch.ground_truths),
                       data_sources=picked(batch.data_sources), extra_infos=picked(batch.extra_infos),
                       indices=list(rows), multi_modal_inputs=picked(batch.multi_modal_inputs or []))


def decode_rows(tokenizer, token_ids, mask) -> list[str]:
    """The text of each row's real tokens (``mask`` 1), special tokens left out."""
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(token_ids, mask)]
