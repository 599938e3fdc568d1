"""CISPO, SAPO, GMPO, GPG, KL-Cov, Clip-Cov and SPPO (with its win-rate estimator) against references written token by token from their papers'
definitions (fp64, Python loops; the gradient through autograd of the reference), in every loss aggregation mode,
with the micro-batch shares of a batch adding up to its loss."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import LOSS_AGG_MODES, get_policy_loss
from tests.numerics import aggregate_by_loops

LOW, HIGH = 0.2, 0.28


def _batch(seed=0, rows=6, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])[:rows]
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    log_probs = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    old = log_probs + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)  # some ratios clip
    advantages = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width).clone()
    advantages[1] += 0.3 * torch.randn(width, generator=g, dtype=torch.float64)  # one row with token advantages
    return log_probs, old, advantages, mask


def _tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def _clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def ref_cispo(lp, old, adv, mask):
    per = {}
    for i, t in _tokens(mask):
        r = torch.exp(lp[i, t] - old[i, t])
        per[(i, t)] = -_clip(r, 1 - LOW, 1 + HIGH).detach() * adv[i, t] * lp[i, t]
    return per


def ref_gpg(lp, old, adv, mask):
    return {(i, t): -adv[i, t] * lp[i, t] for i, t in _tokens(mask)}


def ref_sapo(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    per = {}
    for i, t in _tokens(mask):
        tau = tau_pos if adv[i, t] > 0 else tau_neg
        r = torch.exp(lp[i, t] - old[i, t])
        per[(i, t)] = -(1 / (1 + torch.exp(-tau * (r - 1)))) * 4 / tau * adv[i, t]
    return per


def ref_gmpo(lp, old, adv, mask):
    """The whole loss: mean over sequences of -A_seq * exp(mean_t of the pessimistically clipped log-ratio)."""
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not ts:
            continue
        logs = []
        for t in ts:
            x = lp[i, t] - old[i, t]
            s = math.copysign(1.0, adv[i, t].item()) if adv[i, t] != 0 else 0.0
            logs.append(s * torch.minimum(s * x, s * _clip(x, -LOW, HIGH)))
        a_seq = sum(adv[i, t] for t in ts) / len(ts)
        total = total - a_seq * torch.exp(sum(logs) / len(ts))
        count += 1
    return total / count


def ref_kl_cov(lp, old, adv, mask, ratio, coef):
    tokens = _tokens(mask)
    a_mean = sum(adv[i, t].item() for i, t in tokens) / len(tokens)
    l_mean = sum(lp[i, t].item() for i, t in tokens) / len(tokens)
    cov = {(i, t): (adv[i, t].item() - a_mean) * (lp[i, t].item() - l_mean) for i, t in tokens}
    chosen = set(sorted(tokens, key=lambda k: -cov[k])[:max(1, int(len(tokens) * ratio))])
    per = {}
    for i, t in tokens:
        x = lp[i, t] - old[i, t]
        per[(i, t)] = -adv[i, t] * torch.exp(x) + (coef * torch.abs(x) if (i, t) in chosen else 0.0)
    return per, len(chosen) / len(tokens)


def _run(name, lp, old, adv, mask, mode, **options):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=mask,
                                          clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg_mode=mode,
                                          norm_length=mask.shape[1], **options)
    loss.backward()
    return loss, metrics, lp.grad


def _reference(per_token_fn, lp, old, adv, mask, mode, **kwargs):
    lp = lp.clone().requires_grad_(True)
    value = per_token_fn(lp, old, adv, mask, **kwargs)
    loss = value if isinstance(value, torch.Tensor) else aggregate_by_loops(value, mask, mode, mask.shape[1])
    loss.backward()
    return loss, lp.grad


def _close(a, b):
    # fp64 arithmetic of the same sums in another order: a few ulps of the values' scale
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name, reference", [("cispo", ref_cispo), ("gpg", ref_gpg)])
def test_token_losses_match_their_definition_in_every_mode(name, reference, mode):
    lp, old, adv, mask = _batch()
    loss, metrics, grad = _run(name, lp, old, adv, mask, mode)
    ref_loss, ref_grad = _reference(reference, lp, old, adv, mask, mode)
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    if name == "cispo":
        tokens = _tokens(mask)
        clipped = sum(1 for i, t in tokens if not 1 - LOW <= math.exp(lp[i, t] - old[i, t]) <= 1 + HIGH)
        assert metrics["pg_clipfrac"] == pytest.approx(clipped / len(tokens)) and clipped > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sapo_is_its_gate_averaged_per_sequence_whatever_the_mode(mode):
    lp, old, adv, mask = _batch(1)
    loss, _, grad = _run("sapo", lp, old, adv, mask, mode, tau_pos=1.0, tau_neg=2.0)
    ref_loss, ref_grad = _reference(ref_sapo, lp, old, adv, mask, "seq-mean-token-mean", tau_neg=2.0)
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    other, _, _ = _run("sapo", lp, old, adv, mask, mode, tau_pos=1.0, tau_neg=1.05)
    assert abs(other.item() - loss.item()) > 1e-6  # tau_neg reaches the gate


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gmpo_is_the_sequences_geometric_mean_ratio(mode):
    lp, old, adv, mask = _batch(2)
    loss, metrics, grad = _run("geo_mean", lp, old, adv, mask, mode)
    ref_loss, ref_grad = _reference(ref_gmpo, lp, old, adv, mask, mode)
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    assert metrics["pg_clipfrac"] + metrics["pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_cov_penalises_the_highest_covariance_tokens(mode):
    lp, old, adv, mask = _batch(3)
    ratio, coef = 0.2, 0.5  # a fifth of the 26 tokens: 5 penalised
    loss, metrics, grad = _run("kl_cov", lp, old, adv, mask, mode, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    lp_ref = lp.clone().requires_grad_(True)
    per, fraction = ref_kl_cov(lp_ref, old, adv, mask, ratio, coef)
    ref_loss = aggregate_by_loops(per, mask, mode, mask.shape[1])
    ref_loss.backward()
    _close(loss, ref_loss)
    _close(grad, lp_ref.grad)
    assert metrics["pg_clipfrac"] == pytest.approx(fraction) and fraction > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_clip_cov_cuts_the_gradient_of_a_few_in_range_tokens_and_is_ppo_elsewhere(mode):
    lp, old, adv, mask = _batch(4)
    adv = adv * 6  # covariances of a few units: inside (lb, ub) for several tokens
    options = dict(clip_cov_ratio=0.1, clip_cov_lb=0.2, clip_cov_ub=5.0)
    loss, metrics, grad = _run("clip_cov", lp, old, adv, mask, mode, **options)
    tokens = _tokens(mask)
    a_mean = sum(adv[i, t].item() for i, t in tokens) / len(tokens)
    l_mean = sum(lp[i, t].item() for i, t in tokens) / len(tokens)
    candidates, clipped = set(), set()
    for i, t in tokens:
        r = math.exp(lp[i, t] - old[i, t])
        if -adv[i, t] * min(max(r, 1 - LOW), 1 + HIGH) > -adv[i, t] * r:
            clipped.add((i, t))  # PPO's clip already holds its gradient at 0
        cov = (adv[i, t].item() - a_mean) * (lp[i, t].item() - l_mean)
        if (i, t) not in clipped and options["clip_cov_lb"] < cov < options["clip_cov_ub"]:
            candidates.add((i, t))
    wanted = max(int(options["clip_cov_ratio"] * len(tokens)), 1)
    cut = {(i, t) for i, t in tokens if grad[i, t] == 0} - clipped
    assert len(candidates) > wanted and len(cut) == wanted and cut <= candidates
    assert metrics["pg_clipfrac"] == pytest.approx(wanted / len(tokens))
    # the rest is PPO's clipped loss (no dual clip), token by token
    lp_ref = lp.clone().requires_grad_(True)
    per = {}
    for i, t in tokens:
        r = torch.exp(lp_ref[i, t] - old[i, t])
        ppo = torch.maximum(-adv[i, t] * r, -adv[i, t] * _clip(r, 1 - LOW, 1 + HIGH))
        per[(i, t)] = ppo * (0.0 if (i, t) in cut else 1.0)
    ref_loss = aggregate_by_loops(per, mask, mode, mask.shape[1])
    ref_loss.backward()
    _close(loss, ref_loss)
    _close(grad, lp_ref.grad)


@pytest.mark.parametrize("name", ["cispo", "gpg", "sapo", "geo_mean", "sppo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_shares_add_up_to_the_batch_loss(name, mode):
    """With the step's global counts, each micro-batch's loss is its share (what the engine sums)."""
    lp, old, adv, mask = _batch(5)
    whole, _, whole_grad = _run(name, lp, old, adv, mask, mode)
    counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float((mask.sum(-1) > 0).sum()))
    total, grads = 0.0, []
    for rows in ([0, 1], [2, 3, 4], [5]):
        part = lp[rows].clone().requires_grad_(True)
        share, _ = get_policy_loss(name)(log_probs=part, old_log_probs=old[rows], advantages=adv[rows],
                                         response_mask=mask[rows], clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                         loss_agg_mode=mode, norm_length=mask.shape[1], **counts)
        share.backward()
        total = total + share
        grads.append(part.grad)
    _close(total, whole)
    _close(torch.cat(grads), whole_grad)


def test_sppo_regresses_the_sequence_log_ratio_onto_eta_times_the_win_rate():
    from megarl.algorithms import compute_sppo_advantages

    lp, old, _, mask = _batch(7)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    groups = ["a", "a", "a", "b", "b", "c"]  # c: a lone response
    rewards = torch.zeros_like(lp)
    for i, length in enumerate(mask.sum(-1).long().tolist()):
        rewards[i, length - 1] = scores[i]
    adv, _ = compute_sppo_advantages(token_level_rewards=rewards, response_mask=mask, group_ids=groups)
    # win rates against the prompt's other responses (a tie is half a win), minus 1/2
    expected_rate = {0: (1 + 0.5) / 2, 1: 0.0, 2: (1 + 0.5) / 2, 3: 1.0, 4: 0.0}
    for i in range(6):
        want = expected_rate[i] - 0.5 if i in expected_rate else 0.0
        assert torch.allclose(adv[i][mask[i] > 0], torch.full_like(adv[i][mask[i] > 0], want)), i
    eta = 2.5
    loss, _, grad = _run("sppo", lp, old, adv, mask, "token-mean", sppo_eta=eta)
    lp_ref = lp.clone().requires_grad_(True)
    total = 0.0
    for i in range(6):
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        log_ratio = sum(lp_ref[i, t] - old[i, t] for t in ts)
        total = total + (log_ratio - eta * adv[i, ts[0]]) ** 2
    ref_loss = total / 6
    ref_loss.backward()
    _close(loss, ref_loss)
    _close(grad, lp_ref.grad)


def _pairs(seed=8, pairs=3):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 4, 2, 5, 1])[:rows, None]).double()
    lp = -2 * torch.rand(rows, 5, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(rows, 5, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(rows, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([1.0, -1.0] * pairs, dtype=torch.float64)
    return lp, old, ref, labels[:, None].expand(rows, 5) * mask, mask


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_over_online_pairs_matches_its_definition(loss_type, smoothing):
    lp, old, ref, adv, mask = _pairs()
    beta = 0.3
    options = dict(ref_log_probs=ref, dpo_beta=beta, dpo_loss_type=loss_type, dpo_label_smoothing=smoothing)
    loss, metrics, grad = _run("dpo", lp, old, adv, mask, "token-mean", **options)
    lp_ref = lp.clone().requires_grad_(True)
    total = 0.0
    for pair in range(3):
        c, r = 2 * pair, 2 * pair + 1
        seq = [sum(x[row, t] for t in range(5) if mask[row, t]) for x in (lp_ref, ref) for row in (c, r)]
        margin = (seq[0] - seq[1]) - (seq[2] - seq[3])
        if loss_type == "sigmoid":
            total = total - (1 - smoothing) * torch.log(torch.sigmoid(beta * margin)) \
                - smoothing * torch.log(torch.sigmoid(-beta * margin))
        else:
            total = total + (margin - 1 / (2 * beta)) ** 2
    ref_loss = total / 3
    ref_loss.backward()
    _close(loss, ref_loss)
    _close(grad, lp_ref.grad)
    # two micro-batches of whole pairs, with the step's count of sequences, add up to the batch
    counts = dict(global_num_seqs=6.0, global_num_tokens=float(mask.sum()))
    shares = sum(get_policy_loss("dpo")(log_probs=lp[rows], old_log_probs=old[rows], advantages=adv[rows],
                                        response_mask=mask[rows], clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                        **counts, **dict(options, ref_log_probs=ref[rows]))[0]
                 for rows in ([0, 1], [2, 3, 4, 5]))
    _close(shares, loss)


def test_dpo_refuses_split_pairs_by_the_knob():
    lp, old, ref, adv, mask = _pairs()
    with pytest.raises(ValueError, match=r"not whole \(chosen, rejected\) pairs .*ppo_micro_batch_size_per_gpu even"):
        _run("dpo", lp[1:5], old[1:5], adv[1:5], mask[1:5], "token-mean", ref_log_probs=ref[1:5])


def test_spin_pairs_each_prompts_best_and_worst_and_labels_them():
    from megarl.algorithms import compute_spin_advantages
    from megarl.algorithms.preference import preference_pair_rows

    groups = ["a", "a", "a", "b", "b", "b"]
    scores = torch.tensor([0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    rows = preference_pair_rows(groups, scores)
    assert rows == [1, 0, 3, 4]  # a: best 1, worst 0; b: all tied, the first two (as verl's argmax / argmin)
    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = scores[rows]
    adv, _ = compute_spin_advantages(token_level_rewards=rewards, response_mask=mask,
                                     group_ids=[groups[r] for r in rows])
    assert adv[:, 0].tolist() == [1.0, -1.0, 1.0, -1.0]
    with pytest.raises(ValueError, match="needs actor_rollout_ref.rollout.n >= 2"):
        preference_pair_rows(["a", "b"], torch.tensor([1.0, 0.0]))


def test_rollout_correction_weights_reach_every_loss():
    lp, old, adv, mask = _batch(6)
    weights = 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name in ("cispo", "gpg", "sapo", "geo_mean", "kl_cov", "clip_cov", "sppo"):
        plain, _, _ = _run(name, lp, old, adv, mask, "token-mean")
        lp2 = lp.clone().requires_grad_(True)
        weighted, _ = get_policy_loss(name)(log_probs=lp2, old_log_probs=old, advantages=adv, response_mask=mask,
                                            clip_ratio_low=LOW, clip_ratio_high=HIGH, rollout_is_weights=weights)
        assert abs(weighted.item() - plain.item()) > 1e-6, name


def test_options_out_of_range_are_refused_by_name():
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        _run("kl_cov", lp, old, adv, mask, "token-mean", kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        _run("clip_cov", lp, old, adv, mask, "token-mean", clip_cov_ratio=-1.0)
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        _run("sapo", lp, old, adv, mask, "token-mean", tau_neg=0.0)
