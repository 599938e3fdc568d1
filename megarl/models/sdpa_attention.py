"""Core attention for megatron's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores, fills them with the
mask, runs an fp32 softmax and keeps the probabilities for backward. :class:`SDPADotProductAttention` is
a drop-in replacement (same constructor and forward as ``DotProductAttention`` in megatron-core 0.16-0.19,
plus MLA's ``k_channels`` / ``v_channels``) that lets PyTorch pick a fused kernel:

* a mask that is exactly causal (no padding anywhere in the micro-batch) runs with ``is_causal=True`` and
  no mask tensor, which allows the flash kernel on CUDA;
* any other mask (left-padded prompts, right-padded responses) is passed as a boolean mask, which on CUDA
  selects the memory-efficient kernel (flash takes no arbitrary mask).

Which case applies is decided once per mask tensor (one comparison and one host sync per forward, not per
layer): :func:`prepare_sdpa_mask` caches its answer for the last mask it saw, keyed by identity and version.

Mask convention: megatron's (True = masked) ``[b, 1, sq, sk]``. A query row whose keys are all masked (a
padding query under left padding) would make the softmax 0/0; the diagonal is therefore always allowed.
That changes nothing for real tokens (a real query always sees itself) and gives padding queries a finite
output that differs from the local spec's (it spreads them uniformly over all keys). Neither is used: the
loss masks padding positions and no real query attends to a padding key.

Packed sequences (megatron's ``thd`` format, ``packed_seq_params`` with ``cu_seqlens``; q/k/v arrive as
``[t, heads, dim]``): block-diagonal causal attention. On CUDA in bf16/fp16 one call of PyTorch's
variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``) covers all segments; elsewhere
(CPU, fp32, a torch without it) each segment runs its own causal SDPA call.

Context parallelism (``context_parallel_size > 1``): this rank's queries against the gathered keys and values
of their whole sequence, see :mod:`megarl.models.context_parallel` (always through SDPA with an explicit
mask; the varlen flash kernel is not used there).

Left out: attention dropout > 0, attention bias, sliding windows, softmax offsets ("off-by-one"/"learnable"
softmax), padded ``cu_seqlens`` (``cu_seqlens_q_padded``); each raises.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megarl.models.context_parallel import context_parallel_attention, packed_context_parallel_attention
from megarl.models.tensor_memo import LastTensorMemo

_prepared_masks = LastTensorMemo()  # megatron mask -> the SDPA mask, or None for pure causal


def prepare_sdpa_mask(attention_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """megatron bool mask (True = masked) -> SDPA bool mask (True = attend), or None if exactly causal."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool tensor (True = masked), got {attention_mask.dtype}")
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be [b, 1, sq, sk], got shape {tuple(attention_mask.shape)}")
    return _prepared_masks.get(attention_mask, lambda: _sdpa_mask(attention_mask))


def _sdpa_mask(attention_mask: torch.Tensor) -> Optional[torch.Tensor]:
    sq, sk = attention_mask.shape[-2:]
    eye = torch.eye(sq, sk, dtype=torch.bool, device=attention_mask.device)
    causal = torch.ones(sq, sk, dtype=torch.bool, device=attention_mask.device).triu_(1)
    if sq == sk and torch.equal(attention_mask, causal.expand_as(attention_mask)):
        return None
    return ~attention_mask | eye


def _varlen_flash():
    """PyTorch's variable-length flash attention and the keywords this torch version takes, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


_VARLEN = _varlen_flash()


def _varlen_kwargs(q: torch.Tensor, groups: int, scale: float) -> Optional[dict]:
    """Keywords for a causal ``varlen_attn`` call on ``q`` in this torch version, or None where the flash
    kernel cannot serve it (CPU, fp32, head dim > 256, a custom scale the kernel does not take)."""
    if _VARLEN is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] > 256:
        return None
    keywords = _VARLEN[1]
    if "scale" in keywords:
        kwargs = {"scale": scale}
    elif math.isclose(scale, q.shape[-1] ** -0.5):
        kwargs = {}
    else:
        return None
    kwargs.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
    if q.shape[1] != groups and "enable_gqa" in keywords:
        kwargs["enable_gqa"] = True
    return kwargs


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each segment of packed ``[t, heads, d]`` q and ``[t, groups, d]`` k/v
    (segment i is rows ``cu_seqlens[i]:cu_seqlens[i+1]``) -> ``[t, heads, d_v]``."""
    heads, groups = q.shape[1], k.shape[1]
    kwargs = _varlen_kwargs(q, groups, scale)
    if heads != groups and not (kwargs or {}).get("enable_gqa"):
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    if kwargs is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return _VARLEN[0](q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)
    bounds = cu_seqlens.tolist()
    segments = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [len, h, d] -> [1, h, len, d]
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        segments.append(out[0].transpose(0, 1))
    return torch.cat(segments)


class SDPADotProductAttention(MegatronModule):
    """``DotProductAttention`` (local spec) computed by ``F.scaled_dot_product_attention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPADotProductAttention supports attention_dropout=0 only, got {dropout}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPADotProductAttention supports softmax_type='vanilla' only, "
                             f"got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"SDPADotProductAttention has no sliding-window attention "
                             f"(window_size={config.window_size})")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        if config.context_parallel_size > 1 and self.cp_group is None:
            from megatron.core import parallel_state as mpu

            self.cp_group = mpu.get_context_parallel_group()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp_size = pg_collection.tp.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.hidden_size_per_attention_head = k_channels or config.kv_channels
        self.hidden_size_per_attention_head_v = v_channels or config.kv_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the scores back
        # before the softmax (an fp16 overflow guard): the net scale is unchanged, so it is ignored here.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.softmax_offset = None  # what megatron's code looks up on a core attention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """``[sq, b, np, hn]`` q, ``[sk, b, ng, hn]`` k/v (GQA: ng divides np) -> ``[sq, b, np * hv]``;
        packed (``thd``): ``[t, np, hn]`` q, ``[t, ng, hn]`` k/v -> ``[t, np * hv]``."""
        if attention_bias is not None:
            raise NotImplementedError("SDPADotProductAttention does not support attention_bias")
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, packed_seq_params)
        heads, groups = query.shape[2], key.shape[2]
        if heads % groups or value.shape[2] != groups:
            raise ValueError(f"query has {heads} heads, key {groups} and value {value.shape[2]} groups: "
                             f"the heads must be a multiple of equal key/value groups")
        if self.cp_group is not None:
            return context_parallel_attention(query, key, value, attention_mask, self.cp_group, self.softmax_scale)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if heads != groups:
            # Expanded copies rather than enable_gqa: the memory-efficient kernel (the masked case) does
            # not take GQA inputs, and the copies are small next to the attention itself.
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is None:
            sdpa_mask, is_causal = None, mask_type == AttnMaskType.causal
        else:
            sdpa_mask = prepare_sdpa_mask(attention_mask)
            is_causal = sdpa_mask is None
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=0.0,
                                                 is_causal=is_causal, scale=self.softmax_scale)
        # [b, h, sq, hv] -> [sq, b, h * hv]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)

    def _packed_forward(self, query, key, value, packed_seq_params) -> torch.Tensor:
        params = packed_seq_params
        if params.qkv_format != "thd":
            raise NotImplementedError(f"packed_seq_params.qkv_format {params.qkv_format!r}: only 'thd' is supported")
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise NotImplementedError("padded cu_seqlens (cu_seqlens_*_padded) are not supported; pad with a "
                                      "segment of its own instead")
        if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q \
                and not torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q):
            raise NotImplementedError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        heads, groups = query.shape[1], key.shape[1]
        if heads % groups or value.shape[1] != groups:
            raise ValueError(f"query has {heads} heads, key {groups} and value {value.shape[1]} groups: "
                             f"the heads must be a multiple of equal key/value groups")
        if self.cp_group is not None:
            context = packed_context_parallel_attention(query, key, value, params.cu_seqlens_q, self.cp_group,
                                                        self.softmax_scale)
        else:
            context = packed_causal_attention(query, key, value, params.cu_seqlens_q, params.max_seqlen_q,
                                              self.softmax_scale)
        return context.reshape(context.shape[0], -1)
