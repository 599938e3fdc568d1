"""Per-token log-probabilities and entropy from tensor-parallel (vocab-sharded) logits.

Each TP rank holds the logits of its vocabulary slice ``[vocab_start, vocab_start + V/tp)``. The full-vocab
softmax is never materialised: the forward all-reduces, over the TP group, four small ``[N]`` tensors
(the max, the sum of exp, the target logit, the sum of p * logit), and the backward needs no collective at
all, because the gradient for a vocabulary entry only involves its own probability and the already reduced
per-token scalars. The autograd function keeps one ``[N, V/tp]`` fp32 buffer (the local probabilities) for
the backward, so log-prob and entropy together cost the same memory as one softmax.

Gradients (z = logits / T, p = softmax(z), t = target):
    d log p_t / dz_j = 1[j = t] - p_j
    d H / dz_j       = -p_j (log p_j + H)
Leaves out: masking of vocabulary padding columns (the caller's model owns its padded vocabulary) and
context/sequence-parallel splitting of the sequence dimension (logits here are full-sequence).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, temperature, group):
        local_vocab = logits.shape[-1]
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        else:
            z = z.clone()  # the buffer is turned into probabilities in place below
        z_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        z.sub_(z_max.unsqueeze(-1))  # z is now shifted logits

        in_shard = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_index = torch.where(in_shard, target - vocab_start, torch.zeros_like(target))
        target_z = z.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
        target_z = torch.where(in_shard, target_z, torch.zeros_like(target_z))

        exp_z = z.exp()
        sum_exp = exp_z.sum(dim=-1)
        sum_exp_z = (exp_z * z).sum(dim=-1)
        # One collective for the three sums (they share the group and the op).
        packed = _all_reduce(torch.stack([sum_exp, sum_exp_z, target_z]), dist.ReduceOp.SUM, group)
        sum_exp, sum_exp_z, target_z = packed[0], packed[1], packed[2]

        log_z = sum_exp.log()
        log_probs = target_z - log_z
        entropy = log_z - sum_exp_z / sum_exp

        probs = exp_z.div_(sum_exp.unsqueeze(-1))
        del z
        ctx.save_for_backward(probs, entropy, local_index, in_shard)
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy) skips its backward term
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, entropy, local_index, in_shard = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_log_probs is not None:
            grad.sub_(probs * grad_log_probs.unsqueeze(-1))
            onehot_grad = torch.where(in_shard, grad_log_probs, torch.zeros_like(grad_log_probs))
            grad.scatter_add_(-1, local_index.unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if grad_entropy is not None:
            # p log p is 0 where p underflows to 0 (xlogy), so saturated entries give no NaN.
            p_log_p_plus_h = torch.special.xlogy(probs, probs) + probs * entropy.unsqueeze(-1)
            grad.sub_(p_log_p_plus_h * grad_entropy.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None


def compute_vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(target)`` and the entropy of ``softmax(logits / temperature)`` per position.

    ``logits`` is ``[..., V/tp]`` (this rank's vocabulary slice), ``target`` the matching ``[...]`` token
    ids in the full vocabulary. ``vocab_start`` defaults to ``tp_rank * V/tp`` (megatron's even split).
    With ``tp_group=None`` the logits are taken as the full vocabulary. Returns fp32 ``(log_probs, entropy)``,
    identical on every rank of the group; both are differentiable.

    ``vocab_size`` is the real (tokenizer) vocabulary: columns at or beyond it are megatron's vocab
    padding rows and get zero probability, so the distribution matches the HF/rollout model's exactly.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on leading dims")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_start is None:
        rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
        vocab_start = rank * logits.shape[-1]
    lead_shape = target.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if vocab_size is not None and vocab_start + flat_logits.shape[-1] > vocab_size:
        padded = torch.arange(flat_logits.shape[-1], device=flat_logits.device) + vocab_start >= vocab_size
        # A finite floor, not -inf: the entropy's sum of p * logit must stay 0 * finite on those columns.
        flat_logits = flat_logits.masked_fill(padded, torch.finfo(flat_logits.dtype).min / 2)
    flat_target = target.reshape(-1).long()
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(
        flat_logits, flat_target, int(vocab_start), float(temperature), tp_group
    )
    return log_probs.view(lead_shape), entropy.view(lead_shape)
