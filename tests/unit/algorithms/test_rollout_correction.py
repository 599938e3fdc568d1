"""Rollout correction (megarl.algorithms.rollout_correction) against fp64 references written out here."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.policy_loss import get_policy_loss
from megarl.algorithms.rollout_correction import compute_rollout_correction

torch.manual_seed(0)
B, R = 6, 7
LENGTHS = [7, 5, 3, 7, 1, 4]
MASK = torch.tensor([[1.0] * n + [0.0] * (R - n) for n in LENGTHS])
ROLLOUT = -torch.rand(B, R, dtype=torch.float64) * 3
OLD = ROLLOUT + torch.randn(B, R, dtype=torch.float64) * 0.4  # log r = OLD - ROLLOUT


def ratio(b, t):
    return math.exp(float(OLD[b, t] - ROLLOUT[b, t]))


def correction(**kwargs):
    return compute_rollout_correction(old_log_probs=OLD, rollout_log_probs=ROLLOUT, response_mask=MASK, **kwargs)


def test_token_level_truncated_importance_weights():
    c = correction(rollout_is="token", rollout_is_threshold=1.5)
    for b in range(B):
        for t in range(R):
            expected = min(ratio(b, t), 1.5) if t < LENGTHS[b] else 0.0
            assert float(c.is_weights[b, t]) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(c.loss_mask, MASK)  # no rejection asked for
    truncated = sum(ratio(b, t) > 1.5 for b in range(B) for t in range(LENGTHS[b])) / sum(LENGTHS)
    assert c.metrics["rollout_corr/is_truncated_fraction"] == pytest.approx(truncated)


def test_sequence_level_weights_are_the_product_of_the_ratios():
    c = correction(rollout_is="sequence", rollout_is_threshold="3.0")
    for b in range(B):
        product = math.prod(ratio(b, t) for t in range(LENGTHS[b]))
        for t in range(LENGTHS[b]):
            assert float(c.is_weights[b, t]) == pytest.approx(min(product, 3.0), rel=1e-6)


def test_icepop_zeroes_weights_outside_the_bounds():
    c = correction(rollout_is="token", rollout_is_threshold="0.8_1.25")
    for b in range(B):
        for t in range(LENGTHS[b]):
            r = ratio(b, t)
            assert float(c.is_weights[b, t]) == pytest.approx(r if 0.8 <= r <= 1.25 else 0.0, rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_average_one(level):
    c = correction(rollout_is=level, rollout_is_threshold=100.0, rollout_is_batch_normalize=True)
    if level == "token":
        mean = float((c.is_weights * MASK).sum() / MASK.sum())
    else:
        mean = sum(float(c.is_weights[b, 0]) for b in range(B)) / B
    assert mean == pytest.approx(1.0, rel=1e-6)


def test_token_rejection_by_ratio_bounds():
    c = correction(rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    for b in range(B):
        for t in range(R):
            kept = t < LENGTHS[b] and 0.7 <= ratio(b, t) <= 1.4
            assert float(c.loss_mask[b, t]) == float(kept)
    assert c.is_weights is None
    rejected = sum(not 0.7 <= ratio(b, t) <= 1.4 for b in range(B) for t in range(LENGTHS[b])) / sum(LENGTHS)
    assert c.metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(rejected)
    assert 0 < rejected < 1


def test_sequence_rejection_by_mean_k3_drops_whole_sequences_and_options_combine():
    k3 = [sum(ratio(b, t) - 1 - math.log(ratio(b, t)) for t in range(LENGTHS[b])) / LENGTHS[b] for b in range(B)]
    bound = sorted(k3)[B // 2]  # about half the sequences pass
    c = correction(rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold=f"{bound},1.6")
    for b in range(B):
        for t in range(LENGTHS[b]):
            kept = k3[b] <= bound and 1 / 1.6 <= ratio(b, t) <= 1.6  # one number u for k1: [1/u, u]
            assert float(c.loss_mask[b, t]) == float(kept)


def test_identical_policies_change_nothing():
    c = compute_rollout_correction(old_log_probs=ROLLOUT, rollout_log_probs=ROLLOUT, response_mask=MASK,
                                   rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=1e-12)
    assert torch.equal(c.is_weights, MASK) and torch.equal(c.loss_mask, MASK)
    assert c.metrics["rollout_corr/kl"] == 0.0 and c.metrics["rollout_corr/ppl_ratio"] == 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(rollout_is="tokens"), "rollout_is must be"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), "unknown option"),
    (dict(rollout_rs="token_k1"), "rollout_rs_threshold is required"),
    (dict(rollout_rs="seq_sum_k2", rollout_rs_threshold="0.1_2"), "upper bound only"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1.5,2,3"), "3 values for 2 options"),
    (dict(rollout_is="token", rollout_is_threshold="two"), "rollout_is_threshold"),
])
def test_bad_settings_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        correction(**kwargs)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
def test_policy_loss_weights_each_tokens_loss(name):
    log_probs = OLD.float() + 0.05 * torch.randn(B, R)
    advantages = torch.randn(B, R)
    weights = torch.rand(B, R) * MASK
    args = dict(log_probs=log_probs, old_log_probs=OLD.float(), advantages=advantages, response_mask=MASK,
                clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    loss_fn = get_policy_loss(name)
    unweighted, _ = loss_fn(**args)
    ones, _ = loss_fn(**args, rollout_is_weights=MASK.clone())
    assert float(ones) == pytest.approx(float(unweighted), rel=1e-6)
    weighted, _ = loss_fn(**args, rollout_is_weights=weights)
    # token-mean of the per-token losses times the weights: recover the per-token losses with unit vectors
    per_token = torch.zeros(B, R)
    for b in range(B):
        for t in range(LENGTHS[b]):
            one_hot = torch.zeros(B, R)
            one_hot[b, t] = 1.0
            per_token[b, t] = loss_fn(**args, rollout_is_weights=one_hot)[0] * MASK.sum()
    expected = float((per_token * weights).sum() / MASK.sum())
    assert float(weighted) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_config_keys_are_checked():
    from megarl.config import ConfigError
    from megarl.run_config import load_config

    with pytest.raises(ConfigError, match="bypass_mode"):
        load_config(overrides=["algorithm.rollout_correction.bypass_mode=true"])
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_is"):
        load_config(overrides=["algorithm.rollout_correction.rollout_is=seq"])
    cfg = load_config(overrides=["algorithm.rollout_correction.rollout_is_threshold=0.5_5.0"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_5.0"
    # what compute_rollout_correction would refuse at the first update is refused when the config is loaded
    with pytest.raises(ConfigError, match=r"rollout_rs: unknown option\(s\) \['token_k9'\]"):
        load_config(overrides=["algorithm.rollout_correction.rollout_rs=token_k9",
                               "algorithm.rollout_correction.rollout_rs_threshold=2.0"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold is required with rollout_rs"):
        load_config(overrides=["algorithm.rollout_correction.rollout_rs=token_k1"])
    with pytest.raises(ConfigError, match="rollout_is_threshold: expected a number or 'lower_upper', got 'two'"):
        load_config(overrides=["algorithm.rollout_correction.rollout_is=token",
                               "algorithm.rollout_correction.rollout_is_threshold=two"])
