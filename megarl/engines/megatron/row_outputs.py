"""From what the last pipeline stage outputs per position to per-row results of the responses: log-probs and
entropy from vocab-sharded logits, and whole sequences from a context-parallel rank's share, for padded,
packed (``thd``) and context-parallel micro-batches (:mod:`megarl.engines.megatron.packing`)."""

from __future__ import annotations

from typing import Optional

import torch

from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs
from megarl.engines.megatron.packing import response_positions_of, scatter_to_rows
from megarl.models.context_parallel import gather_sequence


def response_log_probs(output: torch.Tensor, mb: dict, temperature: float,
                       vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``[b, R]`` of the response tokens from vocab-sharded logits (either layout)."""
    from megatron.core import parallel_state as mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    if "cp_bounds" in mb:
        # This rank's positions scored against their next tokens, then every rank's gathered into rows.
        per_position = compute_vocab_parallel_log_probs(output, mb["labels"], tp_group=tp_group,
                                                        temperature=temperature, vocab_size=vocab_size)
        return tuple(scatter_to_rows(response_positions_of(whole_sequence(values, mb), mb), mb)
                     for values in per_position)
    if mb.get("packed_seq_params") is None:
        return compute_vocab_parallel_log_probs(response_positions_of(output, mb), mb["response_ids"],
                                                tp_group=tp_group, temperature=temperature, vocab_size=vocab_size)
    # Packed: score every next token of the stream and keep the response ones. Selecting the response
    # logits first would copy them (and index_add a second logits-sized buffer in backward).
    stream = mb["input_ids"][0]
    log_probs, entropy = compute_vocab_parallel_log_probs(output[0, :-1], stream[1:], tp_group=tp_group,
                                                          temperature=temperature, vocab_size=vocab_size)
    index = mb["response_index"]
    return scatter_to_rows(log_probs[index], mb), scatter_to_rows(entropy[index], mb)


def whole_sequence(per_position: torch.Tensor, mb: dict) -> torch.Tensor:
    """``[b, n, ...]`` results of this CP rank's positions -> ``[b, S, ...]`` of the whole sequence (every
    CP rank's, in order; differentiable). Without context parallelism: unchanged."""
    if "cp_bounds" not in mb:
        return per_position
    from megatron.core import parallel_state as mpu

    gathered = gather_sequence(per_position.transpose(0, 1), mb["cp_bounds"], mpu.get_context_parallel_group(),
                               downstream="replicated")
    return gathered.transpose(0, 1)
