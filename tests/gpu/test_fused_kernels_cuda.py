"""On CUDA: the compiled twins the local spec runs (RMSNorm, whole-stream RoPE) against the eager arithmetic
they replace, forward and backward, in bf16, with tolerances from bf16's precision and the values' scale
(each twin rounds once where eager rounds after every step). Skipped without CUDA (the CPU-compiled
equivalents are in tests/unit/models)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _assert_close_to_scale(got, want, ulps, what):
    scale = want.double().abs().max().item()
    error = (got.double() - want.double()).abs().max().item()
    assert error <= ulps * BF16_EPS * scale, f"{what}: max error {error:.3g} vs scale {scale:.3g}"


def test_fused_rms_norm_is_torchs_rms_norm_forward_and_backward():
    from megarl.models.fused_norm import FusedRMSNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    reference = torch.nn.RMSNorm(1536, eps=1e-6, device="cuda")  # fp32 weight, as megatron builds it
    with torch.no_grad():
        reference.weight.copy_(1 + 0.2 * torch.randn(1536, device="cuda", generator=g))
    fused = FusedRMSNorm(torch.nn.Parameter(reference.weight.detach().clone()), 1e-6)
    for tokens in (4096, 3001):  # two lengths: the twin goes dynamic in the token count
        x = (2 * torch.randn(tokens, 1, 1536, device="cuda", generator=g)).bfloat16().requires_grad_()
        upstream = torch.randn(tokens, 1, 1536, device="cuda", generator=g).bfloat16()
        want = reference(x)
        (want_dx, want_dw) = torch.autograd.grad(want, (x, reference.weight), upstream)
        got = fused(x)
        (got_dx, got_dw) = torch.autograd.grad(got, (x, fused.weight), upstream)
        _assert_close_to_scale(got, want, 2, "output")
        _assert_close_to_scale(got_dx, want_dx, 4, "input grad")
        _assert_close_to_scale(got_dw, want_dw, 8, "weight grad (a sum over tokens)")


def test_compiled_packed_rope_is_megatrons_thd_rope_forward_and_backward():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from types import SimpleNamespace

    from megarl.models import compiled
    from megarl.models.packed_rope import _packed_rotary

    lengths = [700, 1, 333, 1500, 64]
    total, dim = sum(lengths), 128
    g = torch.Generator(device="cuda").manual_seed(1)
    inverse = 1.0 / 1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cuda") / dim)
    angles = torch.outer(torch.arange(max(lengths) + 3, dtype=torch.float32, device="cuda"), inverse)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    config = SimpleNamespace(apply_rope_fusion=False, context_parallel_size=1, multi_latent_attention=False,
                             rotary_interleaved=False)
    t = torch.randn(total, 12, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    upstream = torch.randn(total, 12, dim, device="cuda", generator=g).bfloat16()
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # context parallelism off, no megatron state
    want = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=one_rank)  # megatron's per-sequence path
    (want_grad,) = torch.autograd.grad(want, t, upstream)
    assert compiled.compile_wanted(t.device)
    got = _packed_rotary(apply_rotary_pos_emb, t, freqs, config, cu_seqlens=cu, cp_group=one_rank)
    (got_grad,) = torch.autograd.grad(got, t, upstream)
    _assert_close_to_scale(got, want, 2, "rotated")
    _assert_close_to_scale(got_grad, want_grad, 2, "grad")
