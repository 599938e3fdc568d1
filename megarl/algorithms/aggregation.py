"""Reduce a per-token loss matrix `[B, T]` to a scalar, with an optional global normaliser.

Modes (the names verl users know):
  token-mean               sum(loss * mask) / N_tokens
  seq-mean-token-sum       sum_i sum_t loss_it / N_seqs
  seq-mean-token-mean      sum_i (sum_t loss_it / len_i) / N_seqs
  seq-mean-token-sum-norm  sum_i sum_t loss_it / (N_seqs * norm_length)   (Dr.GRPO: constant length divisor)

N_tokens / N_seqs default to the counts in this call (sequences with no valid token are not counted). In a
micro-batched, data-parallel update pass `global_num_tokens` / `global_num_seqs` (counts over the whole
optimizer step, all ranks): each micro-batch loss then is its share of the full-batch loss, the shares add up to
the full-batch loss, and so do their gradients. The trainer must SUM gradients over micro-batches and ranks
(undo any averaging the DP all-reduce applies). Leaves out: the all-reduce that computes the global counts.
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | int | None = None,
    global_num_seqs: float | int | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Scalar loss from `loss_mat` [B, T] under `mask` [B, T] (1 = real token); see the module docstring.

    `norm_length` is the Dr.GRPO constant (e.g. the configured max response length); it defaults to T, which is
    only constant across micro-batches if they are padded to the same length, so pass it explicitly in training.
    """
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must be the same [B, T]")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")

    if mode == "token-mean":
        num_tokens = mask.sum().item() if global_num_tokens is None else global_num_tokens
        if num_tokens <= 0:
            raise ValueError("aggregate_loss(token-mean): no valid tokens (global_num_tokens or mask sum is 0)")
        return masked_sum(loss_mat, mask) / num_tokens

    seq_lens = mask.sum(dim=-1)
    num_seqs = (seq_lens > 0).sum().item() if global_num_seqs is None else global_num_seqs
    if num_seqs <= 0:
        raise ValueError(f"aggregate_loss({mode}): no sequence with valid tokens (global_num_seqs or count is 0)")
    seq_sums = masked_sum(loss_mat, mask, dim=-1)

    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        seq_means = seq_sums / seq_lens.clamp(min=1).to(seq_sums.dtype)
        return seq_means.sum() / num_seqs
    # seq-mean-token-sum-norm
    length = mask.shape[-1] if norm_length is None else norm_length
    if length <= 0:
        raise ValueError(f"aggregate_loss(seq-mean-token-sum-norm): norm_length must be > 0, got {length}")
    return seq_sums.sum() / (num_seqs * length)
