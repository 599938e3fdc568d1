"""Token entropy from full logits (reference implementation) and the entropy-bonus term.

The trainer computes entropy vocab-parallel inside Megatron; this module only defines the plain formula (for
tests and single-device use) and how the per-token entropy joins the policy loss.
Leaves out: vocab-parallel entropy.
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import aggregate_loss


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the last dim; stable for large logits."""
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(dim=-1)


def add_entropy_bonus(
    policy_loss: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy_coeff: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens=None,
    global_num_seqs=None,
    norm_length=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (policy_loss - entropy_coeff * aggregated entropy, aggregated entropy). The entropy uses the same
    aggregation (and global normaliser) as the policy loss so micro-batch shares still add up."""
    entropy_agg = aggregate_loss(
        entropy, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    return policy_loss - entropy_coeff * entropy_agg, entropy_agg
