"""PPO clip / dual clip / GSPO against per-token Python loops, plus metrics and gradients; every registered loss
against poisoned padding (the other losses' references: test_policy_loss_variants.py)."""

import math

import pytest
import torch

from megarl.algorithms import POLICY_LOSSES, compute_gspo_loss, compute_ppo_clip_loss, get_policy_loss


def _ref_ppo_token(lp, old, a, low, high, c):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    clipped = -a * min(max(r, 1 - low), 1 + high) > -a * r
    lower = False
    if c is not None and a < 0:
        lower = loss > -a * c
        loss = min(loss, -a * c)
    return loss, clipped, lower


def _fixture():
    log_probs = torch.tensor([[-1.0, -0.2, -2.0, -1.0], [-0.5, -3.0, -0.1, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -0.2, -0.5, -1.0], [-0.5, -1.0, -0.6, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -2.0, 5.0], [0.5, 2.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float64)
    return log_probs, old, adv, mask


@pytest.mark.parametrize("clip_c", [None, 1.5])
def test_ppo_clip_token_mean_matches_loop(clip_c):
    lp, old, adv, mask = _fixture()
    low, high = 0.2, 0.28  # asymmetric: DAPO clip-higher
    loss, metrics = compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                          clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c)
    rows = [(i, t) for i in range(2) for t in range(4) if mask[i, t]]
    refs = [_ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), low, high, clip_c) for i, t in rows]
    assert loss.item() == pytest.approx(sum(r[0] for r in refs) / len(refs))
    assert metrics["pg_clipfrac"] == pytest.approx(sum(r[1] for r in refs) / len(refs))
    assert metrics["pg_clipfrac_lower"] == pytest.approx(sum(r[2] for r in refs) / len(refs))
    k1 = sum(old[i, t].item() - lp[i, t].item() for i, t in rows) / len(rows)
    k3 = sum(math.exp(lp[i, t] - old[i, t]) - 1 - (lp[i, t] - old[i, t]).item() for i, t in rows) / len(rows)
    assert metrics["approx_kl_k1"] == pytest.approx(k1) and metrics["ppo_kl"] == pytest.approx(k1)
    assert metrics["approx_kl_k3"] == pytest.approx(k3)
    # token (1, 2): A = -1, ratio e^0.5 = 1.65 > c = 1.5 -> the dual clip is active on exactly 1 of 6 tokens
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.0 if clip_c is None else 1 / 6)


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio e^2 ~ 7.39 on a negative-advantage token: plain PPO loss = 7.39, dual clip caps at c = 3
    lp, old = torch.tensor([[0.0]]), torch.tensor([[-2.0]])
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    plain, _ = compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                     clip_ratio_low=0.2, clip_ratio_high=0.2)
    dual, metrics = compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                          clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert plain.item() == pytest.approx(math.exp(2.0))
    assert dual.item() == pytest.approx(3.0)
    assert metrics["pg_clipfrac_lower"] == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                              clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=0.5)


def test_ppo_gradient_is_zero_when_clipped_and_padding_is_inert():
    lp = torch.tensor([[0.5, -1.0, float("-inf")]], requires_grad=True)  # token 0 ratio e^0.5 > 1.2, A > 0: clipped
    old = torch.tensor([[0.0, -1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                    clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    assert torch.isfinite(loss)
    # d/dlp of -A * exp(lp - old) / 2 at ratio 1 is -0.5; clipped token and padding get no gradient
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5, 0.0]]))


def test_gspo_sequence_ratio_clip_and_gradient():
    lp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -2.2, 0.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    low, high = 0.3, 0.3
    loss, metrics = compute_gspo_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                      clip_ratio_low=low, clip_ratio_high=high)
    # row 0: s = exp(mean(0.2, 0.2)) = e^0.2 = 1.2214 < 1.3 -> not clipped; row 1: s = 1
    s0 = math.exp(0.2)
    expected = ((-s0 - s0) / 2 + (1 + 1 + 1) / 3) / 2
    assert loss.item() == pytest.approx(expected)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # straight-through: d loss / d lp_it = -A_it * s_i / (len_i * num_seqs)
    expected_grad = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [1 / 6, 1 / 6, 1 / 6]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected_grad)


def test_gspo_clips_whole_sequence():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])  # s = e^1 > 1 + eps for every token of the sequence
    adv = torch.tensor([[1.0, 1.0]])
    loss, metrics = compute_gspo_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=torch.ones(1, 2),
                                      clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert metrics["pg_clipfrac"] == 1.0
    loss.backward()
    assert lp.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="gspo has no dual clip"):
        compute_gspo_loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=torch.ones(1, 2),
                          clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=3.0)


def test_registry_and_shape_errors():
    assert get_policy_loss("ppo_clip") is compute_ppo_clip_loss
    with pytest.raises(ValueError, match="registered: cispo, clip_cov, dpo, geo_mean, gpg, gspo, kl_cov, ppo_clip, sapo, sppo"):
        get_policy_loss("vanilla_pg")
    with pytest.raises(ValueError, match="advantages shape"):
        compute_ppo_clip_loss(log_probs=torch.zeros(2, 3), old_log_probs=torch.zeros(2, 3),
                              advantages=torch.zeros(2, 2), response_mask=torch.ones(2, 3),
                              clip_ratio_low=0.2, clip_ratio_high=0.2)


# dpo reads rows as (chosen, rejected) pairs: its own padding check is in test_policy_loss_variants.py
@pytest.mark.parametrize("name", [name for name in POLICY_LOSSES.names() if name != "dpo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padding_never_changes_loss_metrics_or_gradient(name, mode):
    torch.manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    base_lp = -torch.rand(3, 4, dtype=torch.float64)
    old = -torch.rand(3, 4, dtype=torch.float64)
    adv = torch.randn(3, 4, dtype=torch.float64)

    def run(lp_values, old_values, adv_values):
        lp = lp_values.clone().requires_grad_(True)
        loss, metrics = get_policy_loss(name)(log_probs=lp, old_log_probs=old_values, advantages=adv_values,
                                              response_mask=mask, clip_ratio_low=0.1, clip_ratio_high=0.12,
                                              loss_agg_mode=mode, norm_length=4)
        loss.backward()
        return loss.item(), metrics, lp.grad

    clean = run(base_lp, old, adv)
    pad = mask == 0
    lp2, old2, adv2 = base_lp.clone(), old.clone(), adv.clone()
    lp2[pad], old2[pad], adv2[pad] = -1e4, float("nan"), 1e9
    poisoned = run(lp2, old2, adv2)
    assert clean[0] == pytest.approx(poisoned[0])
    assert clean[1] == pytest.approx(poisoned[1])
    torch.testing.assert_close(clean[2], poisoned[2])
    assert (poisoned[2][pad] == 0).all()
