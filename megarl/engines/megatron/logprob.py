"""Per-token log-probabilities and entropy from tensor-parallel (vocab-sharded) logits.

Two autograd functions, chosen by :func:`compute_vocab_parallel_log_probs`:

* TP > 1 (each rank holds the logits of its vocabulary slice ``[vocab_start, vocab_start + V/tp)``): the
  full-vocab softmax is never materialised; the forward all-reduces four small ``[N]`` tensors (the max,
  the sum of exp, the target logit, the sum of p * logit) and the backward needs no collective, because
  the gradient for a vocabulary entry only involves its own probability and the reduced per-token
  scalars. It keeps one ``[N, V/tp]`` fp32 buffer (the local probabilities) for the backward.
* TP = 1 (no group, or a group of one): no collectives and no full-size fp32 buffer at all. Rows are
  processed in chunks of about ``_CHUNK_ELEMENTS`` logits: PyTorch's fused ``log_softmax`` (reading bf16,
  writing fp32 on CUDA) and a gather give the log-probs, the entropy is a row-wise dot of p and log p.
  Only ``[N]`` scalars (log-sum-exp, entropy) are saved; the backward recomputes each chunk's softmax
  from the logits, which autograd keeps alive anyway, so the extra memory is one fp32 chunk, not the
  2x-the-logits fp32 probabilities.

Gradients (z = logits / T, p = softmax(z), t = target):
    d log p_t / dz_j = 1[j = t] - p_j
    d H / dz_j       = -p_j (log p_j + H)
Leaves out: context/sequence-parallel splitting of the sequence dimension (logits here are full-sequence).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megarl.models import compiled


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
        sum_exp_z = torch.linalg.vecdot(exp_z, z)  # no third [N, V] buffer for the product
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


# Logits per chunk of the TP=1 path: 2**28 fp32 temporaries are 1 GiB, about 1,800 rows of a 151,936 vocab.
_CHUNK_ELEMENTS = 2**28


def _row_chunks(rows: int, cols: int):
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    return range(0, rows, step), step


def _chunk_forward(logits: torch.Tensor, target: torch.Tensor, temperature: float):
    """One chunk's fp32 ``(log p(target), entropy, log-sum-exp of z)``; bf16/fp16 logits at T = 1 are read
    directly (no fp32 copy first)."""
    if temperature != 1.0:
        # copy=True: .float() of fp32 logits is the caller's tensor itself, and div_ would change it.
        z = logits.to(torch.float32, copy=True).div_(temperature)
        log_p = torch.log_softmax(z, dim=-1)
    else:
        z = logits
        log_p = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    index = target.unsqueeze(-1)
    log_probs = log_p.gather(-1, index).squeeze(-1)
    log_norm = z.gather(-1, index).squeeze(-1).float() - log_probs
    # H = -sum p log p; exp(-inf) * -inf cannot occur: log_softmax of finite logits is finite.
    entropy = -torch.linalg.vecdot(log_p.exp(), log_p)
    return log_probs, entropy, log_norm


def _chunk_backward(logits, target, log_norm, entropy, grad_log_probs, grad_entropy, temperature: float):
    """d(loss)/d(logits) of one chunk, in the logits' dtype; absent output grads come as zeros.
    d/dz_j = -p_j * (g_lp + g_H * (log p_j + H)) + 1[j = t] * g_lp, divided by T for the logits."""
    log_p = logits.to(torch.float32, copy=True)  # modified in place below
    if temperature != 1.0:
        log_p.div_(temperature)
    log_p.sub_(log_norm.unsqueeze(-1))
    probs = log_p.exp()
    coef = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(grad_log_probs.unsqueeze(-1))
    grad = probs.mul_(coef).neg_()
    grad.scatter_add_(-1, target.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


# On CUDA the chunk functions run torch.compile'd (megarl.models.compiled): Inductor fuses each into a few
# kernels that read the bf16 logits once or twice, instead of ~10 eager passes over fp32 temporaries (the
# log-prob step was ~12% of a 1.5B packed actor update on an H200).


class _FullVocabLogProbEntropy(torch.autograd.Function):
    """TP = 1: chunked fused log-softmax; saves ``[N]`` scalars and recomputes the softmax in backward."""

    @staticmethod
    def forward(ctx, logits, target, temperature):
        rows, cols = logits.shape
        log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(log_probs)
        log_norm = torch.empty_like(log_probs)  # log-sum-exp of z, to rebuild log p = z - log_norm
        starts, step = _row_chunks(rows, cols)
        for start in starts:
            sl = slice(start, start + step)
            log_probs[sl], entropy[sl], log_norm[sl] = compiled.call(_chunk_forward, logits.device, logits[sl],
                                                                     target[sl], temperature)
        ctx.save_for_backward(logits, target, log_norm, entropy)
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, target, log_norm, entropy = ctx.saved_tensors
        zeros = torch.zeros_like(log_norm)
        grad_log_probs = zeros if grad_log_probs is None else grad_log_probs
        grad_entropy = zeros if grad_entropy is None else grad_entropy
        grad = torch.empty_like(logits)
        starts, step = _row_chunks(*logits.shape)
        for start in starts:
            sl = slice(start, start + step)
            grad[sl] = compiled.call(_chunk_backward, logits.device, logits[sl], target[sl], log_norm[sl],
                                     entropy[sl], grad_log_probs[sl], grad_entropy[sl], ctx.temperature)
        return grad, None, None


def _is_single_rank(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


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
    Targets must be real tokens (``< vocab_size``). At TP = 1 the backward reads ``logits`` again, so
    they must not be modified in place between forward and backward (autograd's version check says so).
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
    flat_target = target.reshape(-1).long()
    if _is_single_rank(tp_group) and vocab_start == 0:
        if vocab_size is not None and vocab_size < flat_logits.shape[-1]:
            # The padding columns drop out of the softmax (a strided view, no copy) and get zero gradient.
            flat_logits = flat_logits[:, :vocab_size]
        log_probs, entropy = _FullVocabLogProbEntropy.apply(flat_logits, flat_target, float(temperature))
        return log_probs.view(lead_shape), entropy.view(lead_shape)
    if vocab_size is not None and vocab_start + flat_logits.shape[-1] > vocab_size:
        padded = torch.arange(flat_logits.shape[-1], device=flat_logits.device) + vocab_start >= vocab_size
        # A finite floor, not -inf: the entropy's sum of p * logit must stay 0 * finite on those columns.
        flat_logits = flat_logits.masked_fill(padded, torch.finfo(flat_logits.dtype).min / 2)
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(
        flat_logits, flat_target, int(vocab_start), float(temperature), tp_group
    )
    return log_probs.view(lead_shape), entropy.view(lead_shape)
