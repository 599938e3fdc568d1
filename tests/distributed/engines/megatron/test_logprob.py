"""Vocab-parallel log-prob/entropy against torch.log_softmax on the full vocabulary: values and gradients."""

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_VS_FP64, assert_close_to_scale


def _reference(logits, target, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    chosen = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 4
    logits[0, 0, 3] = 60.0  # a saturated row: p underflows to exactly 0 elsewhere
    target = torch.randint(0, 16, (3, 5), generator=g)
    w_lp = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w_ent = torch.randn(3, 5, generator=g, dtype=torch.float64)
    return logits, target, w_lp, w_ent


def _tp_worker(rank, temperature):
    import torch.distributed as dist

    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs
    from megarl.engines.megatron.parallel import init_distributed

    init_distributed()
    logits, target, w_lp, w_ent = _inputs()
    shard = logits.chunk(dist.get_world_size(), dim=-1)[rank].float().clone().requires_grad_(True)
    log_probs, entropy = compute_vocab_parallel_log_probs(
        shard, target, tp_group=dist.group.WORLD, temperature=temperature)
    ((log_probs * w_lp).sum() + (entropy * w_ent).sum()).backward()
    return log_probs.detach(), entropy.detach(), shard.grad


@pytest.mark.timeout(120)
def test_tp2_log_probs_entropy_and_grads_match_full_vocab():
    temperature = 0.7
    logits, target, w_lp, w_ent = _inputs()
    full = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(full, target, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    results = run_distributed(_tp_worker, 2, temperature)
    grad = torch.cat([r[2] for r in results], dim=-1).double()
    for log_probs, entropy, _ in results:
        assert_close_to_scale(log_probs, ref_lp.detach(), FP32_VS_FP64, "log-probs")
        assert_close_to_scale(entropy, ref_ent.detach(), FP32_VS_FP64, "entropy")
    assert torch.isfinite(grad).all()
    assert_close_to_scale(grad, full.grad, FP32_VS_FP64, "logits grad")


def test_single_rank_only_log_prob_grad_is_onehot_minus_softmax():
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs

    logits, target, _, _ = _inputs(1)
    x = logits.float().clone().requires_grad_(True)
    log_probs, _ = compute_vocab_parallel_log_probs(x, target)
    log_probs.sum().backward()
    expected = torch.nn.functional.one_hot(target, 16).float() - torch.softmax(logits.float(), -1)
    assert_close_to_scale(x.grad, expected, FP32_VS_FP64, "logits grad")


def test_bad_inputs_raise_clear_errors():
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs

    with pytest.raises(ValueError, match="leading dims"):
        compute_vocab_parallel_log_probs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        compute_vocab_parallel_log_probs(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), temperature=0.0)


def test_vocab_padding_columns_get_zero_probability():
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs

    g = torch.Generator().manual_seed(0)
    real_vocab, padded_vocab = 5, 8
    logits = torch.randn(3, 4, padded_vocab, generator=g, requires_grad=True)
    target = torch.randint(0, real_vocab, (3, 4), generator=g)
    log_probs, entropy = compute_vocab_parallel_log_probs(logits, target, vocab_size=real_vocab)
    reference = torch.log_softmax(logits[..., :real_vocab].detach(), dim=-1)
    torch.testing.assert_close(log_probs, reference.gather(-1, target[..., None])[..., 0])
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.all(logits.grad[..., real_vocab:] == 0) and torch.isfinite(logits.grad).all()
