"""Turn sampled token ids into a fixed-width :class:`RolloutBatch`, and decode its rows to text.

Rows are padded to the configured ``max_prompt_length`` / ``max_response_length`` (not to the batch
maximum) so that batches from different ranks and steps concatenate without re-padding. Scoring is
:mod:`megarl.trainer.scoring`'s. Pure functions: no Ray, no engines.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megarl.batch import RolloutBatch


def unpadded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def assemble_rollout_batch(
    *,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    prompt_index: Sequence[int],
    group_ids: Sequence[str],
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    data_sources: Sequence[str] = (),
    ground_truths: Sequence = (),
    extra_infos: Sequence = (),
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    raw_prompts: Sequence = (),
    generated_masks: Sequence[Sequence[int]] | None = None,
    row_extra_infos: Sequence[dict] | None = None,
) -> RolloutBatch:
    """One row per response; ``prompt_index[i]`` says which prompt response ``i`` answers. Multi-turn
    responses bring ``generated_masks`` (1 on the tokens the model generated) and ``row_extra_infos`` (merged
    into their prompt's ``extra_info``: what the reward function sees of the conversation)."""
    rows = len(responses)
    prompt_ids = torch.full((rows, max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, max_prompt_length), dtype=torch.long)
    response_ids = torch.full((rows, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, max_response_length)) if rollout_log_probs is not None else None
    generated = torch.zeros((rows, max_response_length), dtype=torch.long) if generated_masks is not None else None
    for row, (which, response) in enumerate(zip(prompt_index, responses)):
        prompt = prompts[which]
        if len(prompt) > max_prompt_length:
            raise ValueError(f"prompt {which} has {len(prompt)} tokens > data.max_prompt_length={max_prompt_length}")
        if len(response) > max_response_length:
            raise ValueError(
                f"response {row} has {len(response)} tokens > data.max_response_length={max_response_length}"
            )
        if prompt:
            prompt_ids[row, -len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            prompt_mask[row, -len(prompt):] = 1
        if response:
            response_ids[row, : len(response)] = torch.as_tensor(response, dtype=torch.long)
            response_mask[row, : len(response)] = 1
            if log_probs is not None:
                log_probs[row, : len(response)] = torch.as_tensor(rollout_log_probs[row], dtype=torch.float32)
            if generated is not None:
                generated[row, : len(response)] = torch.as_tensor(generated_masks[row], dtype=torch.long)

    def per_row(values: Sequence) -> list:
        return [values[i] for i in prompt_index] if len(values) else []

    extra_infos = per_row(extra_infos)
    if row_extra_infos is not None:
        base = extra_infos or [{}] * rows
        extra_infos = [{**(info or {}), **own} for info, own in zip(base, row_extra_infos)]

    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        group_ids=[group_ids[i] for i in prompt_index], data_sources=per_row(data_sources),
        ground_truths=per_row(ground_truths), extra_infos=extra_infos, rollout_log_probs=log_probs,
        raw_prompts=per_row(raw_prompts), generated_mask=generated,
    )


def conversation_fields(outputs: Sequence) -> dict:
    """``assemble_rollout_batch``'s multi-turn arguments from rollout outputs (none for single responses)."""
    if not outputs or getattr(outputs[0], "loss_mask", None) is None:
        return {}
    return {"generated_masks": [out.loss_mask for out in outputs],
            "row_extra_infos": [{"agent": out.agent} for out in outputs]}


def decode_rows(tokenizer, token_ids, mask) -> list[str]:
    """The text of each row's real tokens (``mask`` 1), special tokens left out."""
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(token_ids, mask)]
