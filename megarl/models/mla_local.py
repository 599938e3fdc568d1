"""Make megatron's MLA run with the local (non-TE) core attention.

megatron-core 0.16's ``MLASelfAttention`` builds its core attention with ``k_channels`` / ``v_channels``
(query/key heads are qk_nope+qk_rope wide, value heads v_head_dim wide), but the local
``DotProductAttention`` does not accept them, so the local MLA spec fails to build. The local attention
math only needs ``kv_channels`` = v_head_dim for the output shape (the bridge sets that) and the softmax
scale MLA passes in; :class:`MLACompatibleDotProductAttention` drops the two arguments.
:func:`patch_mla_core_attention` swaps it into a spec only on versions that need it.
Left out: context parallelism with MLA on the local spec (megatron's local attention refuses CP).
"""

from __future__ import annotations

import inspect

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLACompatibleDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and self.hidden_size_per_attention_head != v_channels:
            raise ValueError(f"MLA on the local spec needs kv_channels == v_head_dim ({v_channels}), "
                             f"got {self.hidden_size_per_attention_head}")


def local_attention_needs_mla_shim() -> bool:
    return "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters


def patch_mla_core_attention(layer_specs) -> None:
    """Replace DotProductAttention by the shim in each MLA layer spec (in place)."""
    if not local_attention_needs_mla_shim():
        return
    for layer_spec in layer_specs:
        attention = layer_spec.submodules.self_attention
        if attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = MLACompatibleDotProductAttention
