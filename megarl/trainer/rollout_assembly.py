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
) -> RolloutBatch:
    """One row per response; ``prompt_index[i]`` says which prompt response ``i`` answers."""
    rows = len(responses)
    prompt_ids = torch.full((rows, max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, max_prompt_length), dtype=torch.long)
    response_ids = torch.full((rows, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, max_response_length)) if rollout_log_probs is not None else None
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

    def per_row(values: Sequence) -> list:
        return [values[i] for i in prompt_index] if len(values) else []

    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        group_ids=[group_ids[i] for i in prompt_index], data_sources=per_row(data_sources),
        ground_truths=per_row(ground_truths), extra_infos=per_row(extra_infos), rollout_log_probs=log_probs,
        raw_prompts=per_row(raw_prompts),
    )


def decode_rows(tokenizer, token_ids, mask) -> list[str]:
    """The text of each row's real tokens (``mask`` 1), special tokens left out."""
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(token_ids, mask)]
