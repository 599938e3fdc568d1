"""The TP=1 log-prob path (chunked fused log-softmax, softmax recomputed in backward) against float64.

Values and gradients of log-prob + entropy, with a temperature, with chunks smaller than the batch (so
several chunks and a ragged last one run), for fp32 and bf16 logits, and with vocabulary padding.
"""

import pytest
import torch

import megarl.engines.megatron.logprob as logprob
from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs
from tests.numerics import FP32_VS_FP64, assert_close_to_scale


def _reference(logits, target, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_entropy_and_grads_match_float64(monkeypatch, dtype, tol, temperature):
    monkeypatch.setattr(logprob, "_CHUNK_ELEMENTS", 3 * 40)  # 3 rows per chunk, 7 rows: chunks 3, 3, 1
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 40, generator=g) * 4).to(dtype)
    logits[0, 5] = 80.0  # saturated row: other probabilities underflow to exactly 0
    target = torch.randint(0, 40, (7,), generator=g)
    w_lp, w_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)
    x = logits.clone().requires_grad_(True)
    log_probs, entropy = compute_vocab_parallel_log_probs(x, target, temperature=temperature)
    ((log_probs * w_lp).sum() + (entropy * w_ent).sum()).backward()

    ref_x = logits.double().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_x, target, temperature)
    ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    assert log_probs.dtype == torch.float32 and x.grad.dtype == dtype
    assert_close_to_scale(log_probs, ref_lp.detach(), FP32_VS_FP64, "log-probs")
    assert_close_to_scale(entropy, ref_ent.detach(), FP32_VS_FP64, "entropy")
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=tol, atol=tol)


def test_only_entropy_grad_and_padding_columns(monkeypatch):
    monkeypatch.setattr(logprob, "_CHUNK_ELEMENTS", 16)
    g = torch.Generator().manual_seed(5)
    real_vocab, padded_vocab = 6, 8
    logits = torch.randn(2, 3, padded_vocab, generator=g, requires_grad=True)
    target = torch.randint(0, real_vocab, (2, 3), generator=g)
    _, entropy = compute_vocab_parallel_log_probs(logits, target, vocab_size=real_vocab)
    entropy.sum().backward()
    ref_x = logits.detach()[..., :real_vocab].double().requires_grad_(True)
    _reference(ref_x, target, 1.0)[1].sum().backward()
    assert_close_to_scale(logits.grad[..., :real_vocab], ref_x.grad, FP32_VS_FP64, "entropy grad")
    assert torch.all(logits.grad[..., real_vocab:] == 0)


def test_fp32_logits_are_not_modified_in_place():
    logits = torch.randn(4, 10, requires_grad=True)
    before = logits.detach().clone()
    log_probs, entropy = compute_vocab_parallel_log_probs(logits, torch.arange(4), temperature=0.5)
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_a_failing_compiled_kernel_falls_back_to_eager_with_a_warning(monkeypatch):
    from megarl.engines.megatron import logprob
    from megarl.models import compiled

    def broken(*args):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(compiled, "_twins", {})
    monkeypatch.setattr(compiled, "_failed", set())
    monkeypatch.setattr(compiled, "compile_wanted", lambda device: True)  # as on CUDA
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    logits = torch.randn(6, 11, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    with pytest.warns(RuntimeWarning, match="inductor exploded"):
        log_probs, _ = compute_vocab_parallel_log_probs(logits, target)
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1))
    log_probs.sum().backward()  # the backward's own kernel compiles (and fails) once, then runs eager
    assert {logprob._chunk_forward, logprob._chunk_backward} <= compiled._failed and logits.grad is not None
