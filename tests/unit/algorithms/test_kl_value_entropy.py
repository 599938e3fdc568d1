"""KL estimators and controllers, KL-in-reward, value loss and entropy against hand computations."""

import math

import pytest
import torch

from megarl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    add_entropy_bonus,
    apply_kl_in_reward,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
)

LP = torch.tensor([[-1.0, -0.5, -30.0]])
REF = torch.tensor([[-2.0, -0.5, 0.0]])


def test_kl_estimators_by_hand():
    torch.testing.assert_close(kl_penalty(LP, REF, "k1"), torch.tensor([[1.0, 0.0, -30.0]]))
    torch.testing.assert_close(kl_penalty(LP, REF, "mse"), torch.tensor([[0.5, 0.0, 450.0]]))
    torch.testing.assert_close(kl_penalty(LP, REF, "k2"), kl_penalty(LP, REF, "mse"))
    torch.testing.assert_close(kl_penalty(LP, REF, "abs"), torch.tensor([[1.0, 0.0, 30.0]]))
    k3 = kl_penalty(LP, REF, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)
    assert k3[0, 1].item() == 0.0
    assert k3[0, 2].item() == 10.0  # clamped
    torch.testing.assert_close(kl_penalty(LP, REF, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="unknown kl estimator 'full'.*k3"):
        kl_penalty(LP, REF, "full")


def test_k3_is_unbiased_estimate_of_true_kl():
    torch.manual_seed(0)
    p_logits, q_logits = 0.5 * torch.randn(5), 0.5 * torch.randn(5)  # q/p stays far below the clamp
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    true_kl = (logp.exp() * (logp - logq)).sum().item()
    samples = torch.multinomial(logp.exp(), 200_000, replacement=True)
    est = kl_penalty(logp[samples], logq[samples], "k3").mean().item()
    assert est == pytest.approx(true_kl, rel=0.05)


def test_adaptive_controller_ziegler_update_and_state_roundtrip():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctrl.update(current_kl=0.2, n_steps=100)  # error = clip(3, .2) = 0.2 -> x (1 + 0.02)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.045, n_steps=500)  # error = -0.1 -> x (1 - 0.05)
    assert ctrl.value == pytest.approx(0.102 * 0.95)
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.state_dict() == ctrl.state_dict()
    fixed = FixedKLController(0.3)
    fixed.update(10.0, 10)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)


def test_apply_kl_in_reward():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    old = torch.tensor([[-1.0, -1.0, 5.0], [-1.0, -2.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=10)
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, ctrl, "k1")
    # k1 = [0.5, 1.0, pad], [0, -1, 0]
    torch.testing.assert_close(rewards, torch.tensor([[-0.25, 0.5, 0.0], [0.0, 0.5, 2.0]]))
    expected_kl = ((0.5 + 1.0) / 2 + (0 - 1 + 0) / 3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(expected_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    err = max(min(expected_kl / 1.0 - 1, 0.2), -0.2)
    assert ctrl.value == pytest.approx(0.5 * (1 + err * 2 / 10))


def test_value_loss_clipping_by_hand():
    values = torch.tensor([[1.0, 0.0, 123.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = compute_value_loss(values=values, old_values=old, returns=returns, response_mask=mask,
                                       cliprange_value=0.5)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25 (clipped wins); token 1: 1 vs 1 -> 1
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert metrics["vf_clipfrac"] == 0.5
    assert metrics["vpred_mean"] == 0.5
    loss.backward()
    # clipped branch carries no gradient to values; token 1: d/dv 0.5 * (v+1)^2 / 2 = 0.5
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5, 0.0]]))


def test_value_clipfrac_counts_no_rounding_ties_inside_the_clip_range():
    # old + (v - old) != v in floating point for these: the clipped branch must still count as inactive
    values = torch.tensor([[0.1, 0.7, 1e-8, 0.3]])
    old = torch.tensor([[0.3, 0.2, 0.4, 0.1]])
    assert not torch.equal(old + (values - old), values)
    returns = torch.tensor([[5.0, -5.0, 3.0, 0.2]])
    _, metrics = compute_value_loss(values=values, old_values=old, returns=returns,
                                    response_mask=torch.ones_like(values), cliprange_value=0.5)
    assert metrics["vf_clipfrac"] == 0.0


def test_entropy_and_bonus():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), 0.0]]), atol=1e-5, rtol=0)
    p = torch.tensor([0.7, 0.2, 0.1])
    assert entropy_from_logits(p.log()).item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    mask = torch.tensor([[1.0, 0.0]])
    total, ent_agg = add_entropy_bonus(torch.tensor(1.0), ent, mask, entropy_coeff=0.01)
    assert ent_agg.item() == pytest.approx(math.log(4))
    assert total.item() == pytest.approx(1.0 - 0.01 * math.log(4))


def test_value_loss_padding_is_inert():
    values = torch.tensor([[1.0, 2.0, 0.0]])
    old = torch.tensor([[0.5, 2.5, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kw = dict(response_mask=mask, cliprange_value=0.2)
    clean = compute_value_loss(values=values, old_values=old, returns=returns, **kw)
    values[0, 2], old[0, 2], returns[0, 2] = 1e6, float("nan"), -1e6
    poisoned = compute_value_loss(values=values, old_values=old, returns=returns, **kw)
    assert clean[0].item() == poisoned[0].item()
    assert clean[1] == poisoned[1]
