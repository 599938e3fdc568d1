"""The rollout engine's routed experts placed in the batch's token layout: the engine counts positions from the
prompt's first token (less a prefix it served from its cache), the batch left-pads prompts; -1 everywhere else."""

import numpy as np
import pytest
import torch

from megarl.data.dataset import PromptBatch
from megarl.engines.rollout.base import RolloutOutput
from megarl.trainer.rollout_assembly import RowWidths, assemble_rollout_batch

WIDTHS = RowWidths(max_prompt_length=5, max_response_length=4, pad_token_id=0)


def _prompts(*prompt_ids):
    n = len(prompt_ids)
    return PromptBatch(prompt_ids=list(prompt_ids), raw_prompts=[None] * n, ground_truths=[None] * n,
                       data_sources=["s"] * n, extra_infos=[{}] * n, indices=list(range(n)))


def _routing(tokens: int, first_value: int) -> np.ndarray:
    return (first_value + np.arange(tokens, dtype=np.int16))[:, None, None].repeat(2, axis=1).repeat(2, axis=2)


def test_routing_lands_on_its_tokens_and_a_cached_prefix_stays_unknown():
    full = RolloutOutput(prompt_index=0, token_ids=[7, 8, 9], log_probs=None, finish_reason="length",
                         routed_experts=_routing(3 + 3 - 1, 10))  # prompt 3 + response 3, less the last token
    cached = RolloutOutput(prompt_index=1, token_ids=[7], log_probs=None, finish_reason="stop",
                           routed_experts=_routing(2, 20), routed_experts_start=2)  # its first 2 tokens cached
    batch = assemble_rollout_batch(_prompts([1, 2, 3], [4, 5, 6, 7]), [full, cached], group_ids=["a", "b"],
                                   widths=WIDTHS)
    routed = batch.routed_experts
    assert routed.shape == (2, 9, 2, 2) and routed.dtype == torch.int16
    # row 0: prompt at positions 2-4, response at 5-7; positions 2..6 routed (the last token, 7, is not)
    assert routed[0, :, 0, 0].tolist() == [-1, -1, 10, 11, 12, 13, 14, -1, -1]
    # row 1: prompt at 1-4, response at 5; the engine routed positions 2-3 of its sequence (1-2 were cached)
    assert routed[1, :, 0, 0].tolist() == [-1, -1, -1, 20, 21, -1, -1, -1, -1]


def test_routing_beyond_the_sequence_or_on_some_rows_only_is_refused():
    too_long = RolloutOutput(prompt_index=0, token_ids=[7], log_probs=None, finish_reason="stop",
                             routed_experts=_routing(4, 0))  # 3 + 1 tokens: only 3 can have been routed
    with pytest.raises(ValueError, match="routed 4 tokens from position 0 of a 3 \\+ 1 token sequence"):
        assemble_rollout_batch(_prompts([1, 2, 3]), [too_long], group_ids=["a"], widths=WIDTHS)
    plain = RolloutOutput(prompt_index=0, token_ids=[7], log_probs=None, finish_reason="stop")
    routed = RolloutOutput(prompt_index=0, token_ids=[7], log_probs=None, finish_reason="stop",
                           routed_experts=_routing(3, 0))
    with pytest.raises(ValueError, match="1 of 2 responses came without routed experts"):
        assemble_rollout_batch(_prompts([1, 2, 3]), [routed, plain], group_ids=["a"], widths=WIDTHS)
