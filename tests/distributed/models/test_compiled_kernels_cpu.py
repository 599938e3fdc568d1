"""What CUDA runs torch.compile'd (the TP=1 log-prob chunk kernels, the packed-RoPE rotation, the fused RMSNorm),
compiled here for the CPU, against the eager functions: values and gradients. Here rather than in tests/unit
because each compiles with inductor (seconds to tens of seconds on 2 cores); the eager formulas' own tests stay
in tests/unit (test_logprob_single_rank, test_packed_rope, test_fused_norm)."""

import pytest
import torch

from megarl.models import compiled
from megarl.models.fused_norm import FusedRMSNorm, rms_norm
from megarl.models.packed_rope import token_positions
from tests.unit.models.test_packed_rope import _rope_inputs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype, temperature", [(torch.bfloat16, 1.0), (torch.float32, 0.7)])
def test_compiled_chunk_kernels_equal_eager(dtype, temperature):
    """What CUDA runs (the torch.compile'd chunk functions) against the eager ones, compiled here for CPU."""
    from megarl.engines.megatron import logprob

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(48, 700, generator=g)).to(dtype)
    target = torch.randint(0, 700, (48,), generator=g)
    forward = torch.compile(logprob._chunk_forward, dynamic=True)
    backward = torch.compile(logprob._chunk_backward, dynamic=True)
    eager_out = logprob._chunk_forward(logits, target, temperature)
    for got, want in zip(forward(logits, target, temperature), eager_out):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, entropy, log_norm = eager_out
    g_lp, g_h = torch.randn(48, generator=g), torch.randn(48, generator=g)
    torch.testing.assert_close(backward(logits, target, log_norm, entropy, g_lp, g_h, temperature).float(),
                               logprob._chunk_backward(logits, target, log_norm, entropy, g_lp, g_h,
                                                       temperature).float(), rtol=1e-2, atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_compiled_rotation_matches_eager_forward_and_backward(interleaved):
    """CUDA runs rotate_stream torch.compile'd; compiled here for the CPU it gives eager's values and grads."""
    from megarl.models.packed_rope import rotate_stream

    t, freqs, cu = _rope_inputs([5, 9, 2], heads=3, dim=16)
    positions = token_positions(cu, t.size(0))
    t = t.detach().requires_grad_()
    upstream = torch.randn_like(t)
    eager = rotate_stream(t, freqs, positions, interleaved, 0.9)
    (eager_grad,) = torch.autograd.grad(eager, t, upstream)
    twin = torch.compile(rotate_stream)
    got = twin(t, freqs, positions, interleaved, 0.9)
    (got_grad,) = torch.autograd.grad(got, t, upstream)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, eager_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_the_compiled_twin_matches_eager_forward_and_backward():
    """CUDA runs the torch.compile'd function; compiled here for the CPU, it must give the same values and grads."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 1, 64, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(64, generator=g).requires_grad_()
    upstream = torch.randn(33, 1, 64, generator=g)
    eager_out = rms_norm(x, weight, 1e-5)
    eager_out.backward(upstream)
    eager_grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    twin = torch.compile(rms_norm)
    for rows in (33, 17):  # a second length: what micro-batches of varying token counts do
        out = twin(x[:rows], weight, 1e-5)
        torch.testing.assert_close(out, eager_out[:rows], rtol=1e-5, atol=1e-6)
    x.grad = weight.grad = None
    twin(x, weight, 1e-5).backward(upstream)
    torch.testing.assert_close(x.grad, eager_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, eager_grads[1], rtol=1e-5, atol=1e-4)


def test_without_eps_the_compiled_path_takes_pytorchs_default_epsilon(monkeypatch):
    monkeypatch.setattr(compiled, "compile_wanted", lambda device: True)  # the CUDA path, compiled for the CPU
    monkeypatch.setattr(compiled, "_twins", {})
    monkeypatch.setattr(compiled, "_failed", set())
    reference = torch.nn.RMSNorm(16)  # eps=None, fp32 weight beside bf16 input: megatron's mix
    fused = FusedRMSNorm(reference.weight, None)
    x = (1e-2 * torch.randn(5, 16)).bfloat16()  # small values: eps is not negligible against mean(x^2)
    torch.testing.assert_close(fused(x), reference(x), rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps)
