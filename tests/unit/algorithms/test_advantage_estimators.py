"""Advantage estimators against plain-Python loop references written here (not the code under test)."""

import math

import pytest
import torch

from megarl.algorithms import get_advantage_estimator

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)


def _rewards_on_last_token(scores, mask):
    r = torch.zeros_like(mask)
    for i, s in enumerate(scores):
        r[i, int(mask[i].sum()) - 1] = s
    return r


def _ref_whiten(rows, mask):
    """Whiten the valid entries of `rows` (list of lists) with unbiased variance, eps 1e-8."""
    flat = [rows[i][t] for i in range(len(rows)) for t in range(len(rows[i])) if mask[i][t]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(rows[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(len(rows[i]))]
            for i in range(len(rows))]


def _ref_gae(rewards, values, mask, gamma, lam):
    """Reverse loop over valid tokens of each row (right padding): next value 0 after the last token."""
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for i in range(len(rewards)):
        n = int(sum(mask[i]))
        last, next_v = 0.0, 0.0
        for t in reversed(range(n)):
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            adv[i][t] = last
            ret[i][t] = last + values[i][t]
            next_v = values[i][t]
    return _ref_whiten(adv, mask), ret


def _call(name, **kw):
    defaults = dict(group_ids=None, values=None, gamma=1.0, lam=1.0, norm_by_std=True, baseline_scores=None, eps=1e-6)
    defaults.update(kw)
    return get_advantage_estimator(name)(**defaults)


def test_gae_matches_reverse_loop():
    torch.manual_seed(0)
    rewards = torch.randn(4, 4, dtype=torch.float64) * MASK
    values = torch.randn(4, 4, dtype=torch.float64)
    adv, ret = _call("gae", token_level_rewards=rewards, response_mask=MASK, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = _ref_gae(rewards.tolist(), values.tolist(), MASK.tolist(), 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_hand_computed_single_row():
    # rewards [0, 1], values [0.5, 0.25], gamma = lam = 1: delta1 = 1 - 0.25, delta0 = 0 + 0.25 - 0.5
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, ret = _call("gae", token_level_rewards=rewards, response_mask=mask, values=values)
    # returns = adv + v: A1 = 0.75, A0 = -0.25 + 0.75 = 0.5 -> R = [1.0, 1.0]
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))


def test_gae_requires_values():
    with pytest.raises(ValueError, match="gae.*requires values"):
        _call("gae", token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3))


def _ref_grpo(scores, uids, norm_by_std, eps=1e-6):
    out = []
    for s, u in zip(scores, uids):
        group = [x for x, v in zip(scores, uids) if v == u]
        if len(group) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(norm_by_std):
    scores = [1.0, 0.0, 0.5, 2.0, 3.0, -1.0]
    uids = ["a", "a", "b", "a", "b", "c"]  # "c" is a singleton group
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
    rewards = _rewards_on_last_token(scores, mask)
    adv, ret = _call("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=uids, norm_by_std=norm_by_std)
    expected = torch.tensor(_ref_grpo(scores, uids, norm_by_std), dtype=torch.float64).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    assert adv[5].abs().sum() == 0  # singleton group


def test_dr_grpo_ignores_std_flag():
    scores = [1.0, 0.0, 4.0]
    mask = torch.ones(3, 2, dtype=torch.float64)
    rewards = _rewards_on_last_token(scores, mask)
    adv, _ = _call("dr_grpo", token_level_rewards=rewards, response_mask=mask, group_ids=[7, 7, 7], norm_by_std=True)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 - 5 / 3, -5 / 3, 4 - 5 / 3], dtype=torch.float64))


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
def test_all_equal_group_scores_give_zero_without_nan(name):
    mask = torch.ones(4, 3)
    rewards = _rewards_on_last_token([1.0, 1.0, 1.0, 1.0], mask)
    adv, ret = _call(name, token_level_rewards=rewards, response_mask=mask, group_ids=["g"] * 4)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv.abs().max() == 0


def test_rloo_matches_loop():
    scores = [1.0, 0.0, 0.5, 2.0, 3.0]
    uids = [0, 0, 1, 0, 1]
    mask = torch.ones(5, 2, dtype=torch.float64)
    adv, _ = _call("rloo", token_level_rewards=_rewards_on_last_token(scores, mask), response_mask=mask, group_ids=uids)
    expected = []
    for i, (s, u) in enumerate(zip(scores, uids)):
        others = [x for j, (x, v) in enumerate(zip(scores, uids)) if v == u and j != i]
        expected.append(s - sum(others) / len(others))
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected, dtype=torch.float64))


def test_opo_length_weighted_baseline():
    # lengths 1, 3; scores 1, 0 -> baseline = (1*1 + 3*0) / 4 = 0.25
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    rewards = _rewards_on_last_token([1.0, 0.0], mask)
    adv, _ = _call("opo", token_level_rewards=rewards, response_mask=mask, group_ids=["p", "p"])
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0, 0], [-0.25, -0.25, -0.25]], dtype=torch.float64))


def test_reinforce_plus_plus_discounted_and_whitened():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    gamma = 0.5
    adv, ret = _call("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=gamma)
    ref_ret = [[0.0 + 0.5 * (1 + 0.5 * 2), 1 + 0.5 * 2, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(_ref_whiten(ref_ret, mask.tolist()), dtype=torch.float64))


def test_reinforce_plus_plus_baseline_matches_loop():
    scores = [1.0, 0.0, 3.0, 5.0]
    uids = ["a", "a", "b", "b"]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.float64)
    adv, _ = _call("reinforce_plus_plus_baseline", token_level_rewards=_rewards_on_last_token(scores, mask),
                   response_mask=mask, group_ids=uids)
    centred = [0.5, -0.5, -1.0, 1.0]
    rows = [[c * m for m in row] for c, row in zip(centred, mask.tolist())]
    torch.testing.assert_close(adv, torch.tensor(_ref_whiten(rows, mask.tolist()), dtype=torch.float64))


def test_remax_subtracts_greedy_baseline_and_requires_it():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    baseline = torch.tensor([0.25, 1.0])
    adv, ret = _call("remax", token_level_rewards=rewards, response_mask=mask, baseline_scores=baseline)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [2.5, 2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0], [1.5, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="remax.*baseline_scores"):
        _call("remax", token_level_rewards=rewards, response_mask=mask)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
def test_group_estimators_require_group_ids_of_batch_length(name):
    rewards, mask = torch.zeros(3, 2), torch.ones(3, 2)
    with pytest.raises(ValueError, match="group_ids"):
        _call(name, token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="2 entries but the batch has 3 rows"):
        _call(name, token_level_rewards=rewards, response_mask=mask, group_ids=["a", "b"])


@pytest.mark.parametrize(
    "name,extra",
    [("gae", "values"), ("grpo", None), ("dr_grpo", None), ("rloo", None), ("opo", None),
     ("reinforce_plus_plus", None), ("reinforce_plus_plus_baseline", None), ("remax", "baseline")],
)
def test_padding_values_never_matter(name, extra):
    torch.manual_seed(1)
    mask = MASK.clone()
    rewards = torch.randn(4, 4, dtype=torch.float64)
    values = torch.randn(4, 4, dtype=torch.float64)
    kw = dict(response_mask=mask, group_ids=["x", "x", "y", "y"], gamma=0.9, lam=0.95,
              baseline_scores=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))
    adv1, ret1 = _call(name, token_level_rewards=rewards.clone(), values=values.clone(), **kw)
    pad = mask == 0
    rewards[pad] = float("nan")
    values[pad] = 1e6
    adv2, ret2 = _call(name, token_level_rewards=rewards, values=values, **kw)
    torch.testing.assert_close(adv1, adv2)
    torch.testing.assert_close(ret1, ret2)
    assert (adv2[pad] == 0).all()


def test_unknown_estimator_lists_registered():
    with pytest.raises(ValueError, match="registered: .*gae.*grpo"):
        get_advantage_estimator("ppo2")


def test_gae_skips_mask_holes():
    # a masked hole in the middle (e.g. tool output) is transparent: same result as the row without it
    rewards = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.25], [0.5, 0.25, 0.0]], dtype=torch.float64)
    holed = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.float64)
    _, ret = _call("gae", token_level_rewards=rewards, response_mask=holed, values=values, gamma=0.9, lam=0.8)
    assert ret[0, 1] == 0
    torch.testing.assert_close(ret[0, [0, 2]], ret[1, [0, 1]])


def test_registering_a_taken_name_fails():
    from megarl.algorithms import register_advantage

    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage("grpo")(lambda **kw: None)


# Group estimators whose advantages are defined from group (and, last one, batch) statistics.
GROUP_STATISTICS = [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True), ("opo", True),
                    ("reinforce_plus_plus_baseline", True)]


@pytest.mark.parametrize("name,norm_by_std", GROUP_STATISTICS)
@pytest.mark.parametrize("value", [2.3, 0.7, 1.1, 0.1, -1 / 3, 1e-7, 12345.678, 0.0])
def test_all_equal_groups_get_exactly_zero_in_float32(name, norm_by_std, value):
    """A group whose responses all scored alike has nothing to prefer: advantage exactly 0 in fp32, for any
    group size (1..512) and values that float32 cannot represent exactly. Several groups share the batch,
    with different lengths, so neither the batch nor the group layout hides the rounding."""
    sizes = list(range(1, 33)) + [63, 64, 100, 128, 255, 256, 511, 512]
    rows = sum(sizes)
    length = 5
    mask = torch.zeros(rows, length, dtype=torch.float32)
    group_ids, row = [], 0
    for group, size in enumerate(sizes):
        for member in range(size):
            mask[row, : 1 + (row * 7 + member) % length] = 1
            group_ids.append(group)
            row += 1
    rewards = torch.zeros(rows, length, dtype=torch.float32)
    last = mask.sum(dim=1).long() - 1
    rewards[torch.arange(rows), last] = torch.tensor(value, dtype=torch.float32)
    advantages, returns = get_advantage_estimator(name)(
        token_level_rewards=rewards, response_mask=mask, group_ids=group_ids, norm_by_std=norm_by_std)
    assert advantages.dtype == torch.float32
    assert torch.count_nonzero(advantages).item() == 0, advantages.abs().max().item()


@pytest.mark.parametrize("name,norm_by_std", GROUP_STATISTICS[:5])
def test_group_advantages_equal_a_float64_reference(name, norm_by_std):
    """Random float32 scores in groups of 1..64: the fp32 output is the fp64 reference rounded once (relative
    to the advantages' scale, a few float32 ulps)."""
    generator = torch.Generator().manual_seed(0)
    sizes = [1, 2, 3, 5, 8, 16, 33, 64]
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    scores = (torch.randn(len(group_ids), generator=generator) * 3 + 1).to(torch.float32)
    mask = torch.ones(len(group_ids), 3)
    rewards = torch.zeros(len(group_ids), 3)
    rewards[:, -1] = scores
    advantages, _ = get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask,
                                                  group_ids=group_ids, norm_by_std=norm_by_std)
    expected = []
    for group, size in enumerate(sizes):
        members = [float(scores[i]) for i, g in enumerate(group_ids) if g == group]
        mean = math.fsum(members) / size
        for x in members:
            if size == 1:
                expected.append(0.0)
            elif name == "rloo":
                expected.append(x - (math.fsum(members) - x) / (size - 1))
            elif name in ("grpo", "dr_grpo"):
                std = math.sqrt(math.fsum((y - mean) ** 2 for y in members) / (size - 1))
                expected.append((x - mean) / (std + 1e-6) if name == "grpo" and norm_by_std else x - mean)
            else:  # opo with equal lengths: the plain group mean
                expected.append(x - mean)
    expected = torch.tensor(expected, dtype=torch.float64)
    scale = expected.abs().max()
    assert ((advantages[:, 0].double() - expected).abs().max() / scale).item() < 4 * 2.0**-24


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_batch_whitening_of_equal_values_is_exactly_zero(name):
    """Whitening over the batch's tokens: equal returns (REINFORCE++ with gamma=1) or equal GAE advantages
    (rewards equal to the values' differences) whiten to exactly 0."""
    rows, length = 300, 7
    mask = torch.ones(rows, length)
    rewards = torch.zeros(rows, length)
    rewards[:, -1] = 2.3
    values = torch.full((rows, length), 2.3) if name == "gae" else None
    advantages, _ = get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask, values=values,
                                                  group_ids=list(range(rows)))
    assert torch.count_nonzero(advantages).item() == 0, advantages.abs().max().item()
