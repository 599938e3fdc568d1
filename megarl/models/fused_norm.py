"""RMSNorm in one fused kernel each way on CUDA, for megatron's local layer spec.

Without Transformer Engine or Apex, megatron's local spec builds ``torch.nn.RMSNorm``, whose CUDA path is
PyTorch's composite: upcast, square, mean, add, rsqrt, multiply, cast, multiply by the weight, each its own
kernel over the whole activation, and about as many again in the backward. For a 1.5B model's packed update on
an H200 the norms took ~11% of the GPU time (``docs/benchmarks.md``): the local spec made its norm weights fp32
beside bf16 activations (megarl's engines now cast them to the model's dtype), and PyTorch's own fused kernel
refused the mixed dtypes. :class:`FusedRMSNorm` computes the same
formula (fp32 statistics, normalised value cast to the input's dtype, then times the weight, as PyTorch and HF's
Qwen2/Llama norms do) through a torch.compile'd function; on CPU it calls PyTorch's ``rms_norm`` itself.

:func:`fuse_rms_norms` swaps the norms of a built model in place, keeping each ``weight`` Parameter (state-dict
keys, optimizer and checkpoint layout are unchanged).
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.models import compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # the weight is the model's dtype (megarl's engines) or fp32 (megatron's local spec as built: WrappedTorchNorm
    # passes no dtype); the output stays in the input's dtype either way, as PyTorch's rms_norm returns it
    return (normalised.type_as(x) * weight).type_as(x)


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter, eps: Optional[float]):
        super().__init__()
        self.weight = weight
        self.eps = eps  # None: PyTorch's default, resolved per input in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not compiled.compile_wanted(x.device):
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # PyTorch's default: the epsilon of the dtype the statistics are computed in (fp32 for bf16/fp16 input)
        eps = self.eps if self.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        return compiled.call(rms_norm, x.device, x, self.weight, eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace every ``torch.nn.RMSNorm`` (with a weight, over the last dimension) in ``model``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.RMSNorm and child.weight is not None and len(child.normalized_shape) == 1:
                setattr(parent, name, FusedRMSNorm(child.weight, child.eps))
                replaced += 1
    return replaced
