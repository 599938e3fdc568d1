"""Rotary embeddings for packed (``thd``) micro-batches in a few whole-stream kernels.

megatron's unfused ``thd`` path (used when TE's fused RoPE is not there: the local spec) applies RoPE one
packed sequence at a time: ``cu_seqlens.tolist()`` (a host sync that drains the launch queue), then per
sequence a slice, a rotation and a copy into the output, for the query and the key of every layer. With
tens of sequences per micro-batch that is thousands of small kernels and a stall per layer per step.

Here every token's position inside its own sequence is computed once per micro-batch on the device
(``arange - start of its sequence``; no host sync: the stream's length is known on the host), the
frequencies are gathered for all tokens at once, and the same rotation megatron uses for ``bshd`` is applied
to the whole stream. Per element the arithmetic is megatron's own, so the result is bit-identical
(``tests/unit/models/test_packed_rope.py``); on CUDA that arithmetic runs torch.compile'd
(:mod:`megarl.models.compiled`), one fused kernel each way instead of ~8, equal to megatron's up to the
roundings of its intermediate steps.

Taken only where that equivalence is exact: ``thd`` input, context parallelism off, no TE fusion, and
frequencies of the longest sequence (not per-token frequencies of the whole stream, which megatron 0.19 reads
with offsets); everything else goes to megatron's function unchanged.
"""

from __future__ import annotations

import functools

import torch

from megarl.models import compiled
from megarl.models.tensor_memo import LastTensorMemo

_positions = LastTensorMemo()  # cu_seqlens -> each token's position inside its sequence


def token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` positions, restarting at 0 at every ``cu_seqlens`` boundary (``total == cu_seqlens[-1]``)."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)  # output_size: no host sync
    return torch.arange(total, device=cu.device) - starts


def _packed_rotary(original, t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0,
                   cp_group=None, **kwargs) -> torch.Tensor:
    if (cu_seqlens is None or getattr(config, "apply_rope_fusion", False) or config.context_parallel_size > 1
            or getattr(config, "multi_latent_attention", False) or freqs.size(0) == t.size(0)
            or (cp_group is not None and cp_group.size() > 1)):
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)
    positions = _positions.get(cu_seqlens, lambda: token_positions(cu_seqlens.to(freqs.device), t.size(0)))
    return compiled.call(rotate_stream, t.device, t, freqs, positions, bool(config.rotary_interleaved), float(mscale))


def rotate_stream(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, rotary_interleaved: bool,
                  mscale: float) -> torch.Tensor:
    """``t`` ``[T, heads, dim]`` rotated by each token's frequencies ``freqs[positions]``: megatron's ``bshd``
    arithmetic over the whole stream (eager: bit for bit; compiled on CUDA: one kernel each way, the gather,
    cos/sin and the rotation fused, rounding once instead of after every step)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
                                      mscale=mscale).squeeze(1)


def use(enabled: bool = True) -> None:
    """Route megatron's attention layers' RoPE through :func:`_packed_rotary` (or back to megatron's own with
    ``enabled=False``: benchmarks compare the two in one process). Idempotent."""
    from megatron.core.transformer import attention

    current = attention.apply_rotary_pos_emb
    original = getattr(current, "__wrapped__", current) if getattr(current, "_megarl_packed", False) else current
    if not enabled:
        attention.apply_rotary_pos_emb = original
        return
    if current is not original:
        return
    patched = functools.wraps(original)(functools.partial(_packed_rotary, original))
    patched._megarl_packed = True
    attention.apply_rotary_pos_emb = patched
