"""Context parallelism (CP) for the local layer spec: each sequence split over the CP ranks.

Layout (megatron's load-balanced one, which its RoPE already follows): a sequence whose length is a
multiple of ``2 * cp`` is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, so every rank gets the same share of causal-attention work. Packed (``thd``) streams
apply this per segment (each segment's length a multiple of ``2 * cp``; ``cu_seqlens`` keep the full
lengths, as megatron's ``thd`` RoPE expects), so a rank's stream is its two chunks of every segment.

Attention gathers the keys and values of the whole sequence on every CP rank (one all-gather per layer,
as in Llama 3's training, rather than ring attention: small with grouped-query attention, nothing to
overlap) and runs this rank's queries against them with the causal mask in global positions.

Two differentiable gathers, told apart by what happens downstream:

* keys/values (:func:`gather_sequence` with ``downstream="per_rank"``): each rank's queries differ, so a
  rank's K/V gradient is the *sum* of what every rank sends back (reduce-scatter);
* per-token results for the loss (``downstream="replicated"``: log-probs, entropy, values): every rank
  computes the same loss from the gathered rows, so a rank's gradient is just its own slice.

With these, the CP ranks' parameter gradients add up to the gradient of the loss, which is what
megatron's schedule (loss x cp) and DDP (average over DP x CP) then produce.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.tensor_memo import LastTensorMemo


def chunk_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (within one sequence of ``length`` tokens) held by ``cp_rank``, in its local order."""
    if length % (2 * cp_size):
        raise ValueError(f"a context-parallel sequence needs a length divisible by 2 * cp = {2 * cp_size}, "
                         f"got {length}")
    chunk = length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _stream_positions(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Stream positions held by ``cp_rank`` of a packed stream with segment boundaries ``bounds``."""
    return torch.cat([start + chunk_positions(end - start, cp_size, cp_rank)
                      for start, end in zip(bounds[:-1], bounds[1:])])


@lru_cache(maxsize=64)
def local_positions(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of this rank's tokens; ``bounds`` are segment boundaries (``(0, S)`` for rows)."""
    return _stream_positions(bounds, cp_size, cp_rank)


@lru_cache(maxsize=64)
def gathered_to_global(bounds: tuple[int, ...], cp_size: int) -> torch.Tensor:
    """Index into a rank-major gather of every rank's local tokens that yields the global order."""
    gathered = torch.cat([_stream_positions(bounds, cp_size, rank) for rank in range(cp_size)])
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(len(gathered))
    return order


def _uses_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    if _uses_nccl(group):
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.chunk(world)), x.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, replicated_downstream):
        ctx.group, ctx.replicated = group, replicated_downstream
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if ctx.replicated:
            return grad.chunk(world)[rank].contiguous(), None, None
        grad = grad.contiguous()
        if _uses_nccl(group):
            out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(world)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, bounds: tuple[int, ...], group, *, downstream: str) -> torch.Tensor:
    """Every CP rank's local tokens (dim 0 of ``x``) -> the whole sequence/stream in global order.

    ``downstream``: ``"per_rank"`` when ranks use the result differently (K/V), ``"replicated"`` when every
    rank computes the same thing from it (see the module docstring)."""
    if downstream not in ("per_rank", "replicated"):
        raise ValueError(f"downstream must be 'per_rank' or 'replicated', got {downstream!r}")
    world = dist.get_world_size(group)
    if torch.is_grad_enabled() and x.requires_grad:
        gathered = _GatherSequence.apply(x, group, downstream == "replicated")
    else:
        gathered = _all_gather_dim0(x, group)
    return gathered.index_select(0, gathered_to_global(bounds, world).to(x.device))


# ----------------------------------------------------------------------------------------- attention

_prepared_masks = LastTensorMemo()  # megatron mask rows of this rank -> the SDPA mask


def _query_key_mask(attention_mask: Optional[torch.Tensor], query_positions: torch.Tensor,
                    length: int) -> torch.Tensor:
    """SDPA bool mask (True = attend) of this rank's queries over all ``length`` keys.

    ``attention_mask``: megatron's (True = masked) rows of this rank's queries, ``[b, 1, n, length]``; None
    means causal. A query always sees itself (padding queries would otherwise be all-masked, a 0/0)."""
    keys = torch.arange(length, device=query_positions.device)
    if attention_mask is None:
        return keys[None, :] <= query_positions[:, None]
    if attention_mask.shape[-2:] != (len(query_positions), length):
        raise ValueError(f"with context parallelism the attention mask holds this rank's query rows: expected "
                         f"[b, 1, {len(query_positions)}, {length}], got {tuple(attention_mask.shape)}")
    return _prepared_masks.get(attention_mask,
                               lambda: ~attention_mask | (keys[None, :] == query_positions[:, None]))


def _gather_key_values(key: torch.Tensor, value: torch.Tensor, bounds, group):
    """K and V of the whole sequence in one collective (concatenated on the head dim; MLA's differ)."""
    key_dim = key.shape[-1]
    both = gather_sequence(torch.cat([key, value], dim=-1), bounds, group, downstream="per_rank")
    return both[..., :key_dim], both[..., key_dim:]


def _expand_groups(q, k, v, head_dim: int):
    heads, groups = q.shape[head_dim], k.shape[head_dim]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=head_dim)
        v = v.repeat_interleave(heads // groups, dim=head_dim)
    return k, v


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], group, scale: float) -> torch.Tensor:
    """Rows layout: ``[n, b, h, d]`` local q/k/v (``n = S / cp``) -> ``[n, b, h * d_v]``."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    length = query.shape[0] * cp_size
    bounds = (0, length)
    key, value = _gather_key_values(key, value, bounds, group)
    positions = local_positions(bounds, cp_size, cp_rank).to(query.device)
    mask = _query_key_mask(attention_mask, positions, length)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    k, v = _expand_groups(q, k, v, head_dim=1)
    context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


@lru_cache(maxsize=64)
def _packed_blocks(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> tuple[tuple[int, int, int, int], ...]:
    """(local query start, query count, global key start, key count) of each causal block of this rank:
    two per segment, its chunks ``r`` and ``2cp-1-r``, each seeing its segment up to the chunk's end."""
    blocks = []
    local = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            blocks.append((local, chunk, start, (index + 1) * chunk))
            local += chunk
    return tuple(blocks)


def packed_context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      cu_seqlens: torch.Tensor, group, scale: float) -> torch.Tensor:
    """Packed layout: ``[t, h, d]`` local q/k/v of a stream whose full segments are ``cu_seqlens`` ->
    ``[t, h, d_v]``."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = _bounds_of(cu_seqlens)
    key, value = _gather_key_values(key, value, bounds, group)
    key, value = _expand_groups(query, key, value, head_dim=1)
    outputs = []
    for q_start, q_count, k_start, k_count in _packed_blocks(bounds, cp_size, cp_rank):
        if q_count == 0:
            continue
        # [len, h, d] -> [1, h, len, d]; the block's queries are its last q_count keys' positions
        qs = query[q_start:q_start + q_count].transpose(0, 1)[None]
        ks, vs = (t[k_start:k_start + k_count].transpose(0, 1)[None] for t in (key, value))
        mask = torch.ones(q_count, k_count, dtype=torch.bool, device=query.device).tril(k_count - q_count)
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


_segment_bounds = LastTensorMemo()  # cu_seqlens -> its values on the host


def _bounds_of(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple, one host sync per micro-batch (every layer passes the same tensor)."""
    return _segment_bounds.get(cu_seqlens, lambda: tuple(cu_seqlens.tolist()))
