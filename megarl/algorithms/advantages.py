"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (plain and with group baseline), ReMax, OPO.

All estimators share one keyword-only signature so the trainer can call any of them by name:

    fn(*, token_level_rewards [B, T], response_mask [B, T], group_ids: Sequence | None, values=None,
       gamma=1.0, lam=1.0, norm_by_std=True, baseline_scores=None, eps=1e-6) -> (advantages, returns)

Each ignores the arguments it does not use and raises ValueError when one it needs is missing. Outputs are
[B, T] and zero on padding. Outcome-reward estimators (GRPO, RLOO, ReMax, OPO, REINFORCE++-baseline) take the
sequence score as the sum of valid `token_level_rewards` (the reward manager puts it on the last token).

Groups of size 1 get advantage 0 in GRPO/RLOO/REINFORCE++-baseline/OPO: a lone sample has no peers to be better
or worse than. (verl instead uses mean 0, std 1 there, i.e. the raw score.) Masked positions are transparent in
the recursive estimators (GAE, REINFORCE++): they neither add reward nor advance the discount, so mask holes
(e.g. tool output in multi-turn) are skipped rather than treated as episode ends.

Leaves out: the length normalisation of Dr.GRPO, which lives in the loss aggregation
(`seq-mean-token-sum-norm`), and any distributed statistics (whitening uses the local batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from megarl.algorithms.masked import masked_whiten
from megarl.algorithms.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
# estimators whose baseline is the other responses to the same prompt: they need several per prompt
GROUP_ESTIMATORS: set[str] = set()


def register_advantage(name: str, *, uses_groups: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Add an estimator under ``name``; ``uses_groups``: its baseline comes from the prompt's other responses."""
    add = ADVANTAGE_ESTIMATORS.register(name)

    def add_estimator(fn: AdvantageFn) -> AdvantageFn:
        fn = add(fn)  # a taken name fails here, before it is marked
        if uses_groups:
            GROUP_ESTIMATORS.add(name)
        return fn

    return add_estimator


def get_advantage_estimator(name: str) -> AdvantageFn:
    return ADVANTAGE_ESTIMATORS.get(name)


# ----------------------------------------------------------------------------------------------- input checks


def _check_token_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}")
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )


def _require(value, name: str, estimator: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} requires {name}, got None")
    return value


def _group_index(group_ids: Sequence | None, batch_size: int, estimator: str) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable uids to dense group indices 0..G-1 (first-seen order)."""
    group_ids = _require(group_ids, "group_ids (one uid per row)", estimator)
    ids = list(group_ids.tolist() if hasattr(group_ids, "tolist") else group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"{estimator}: group_ids has {len(ids)} entries but the batch has {batch_size} rows")
    dense: dict = {}
    index = [dense.setdefault(uid, len(dense)) for uid in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row score in float64: the group statistics that follow are computed in float64, where a sum of up
    to 2**29 equal float32 values is exact, so a group whose scores are all equal has a mean equal to each
    of them and advantage exactly 0 (in float32 the running sum's rounding error, divided by a near-zero
    std + eps, came out as advantages of +-0.1 to 0.6)."""
    rewards = token_level_rewards.to(torch.float64)
    return torch.where(response_mask.bool(), rewards, torch.zeros_like(rewards)).sum(-1)


def _group_stats(scores: torch.Tensor, index: torch.Tensor, num_groups: int, weights: torch.Tensor | None = None):
    """Per-row group size, (weighted) group mean and unbiased group std, gathered back to rows."""
    index = index.to(scores.device)
    ones = torch.ones_like(scores)

    def per_group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, x)

    size = per_group_sum(ones)
    w = ones if weights is None else weights.to(scores.dtype)
    mean = per_group_sum(w * scores) / per_group_sum(w).clamp(min=1e-12)
    sq_dev = per_group_sum((scores - mean[index]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    return size[index], mean[index], std[index]


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row values onto the row's valid tokens, in the rewards' ``dtype`` (computed in float64 before)."""
    return per_seq.unsqueeze(-1).to(dtype) * response_mask.to(dtype)


# ----------------------------------------------------------------------------------------------- estimators


@register_advantage("gae")
def compute_gae_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """Generalised Advantage Estimation (Schulman et al. 2016). The value after the last valid token is 0
    (terminal). Returns are advantages + values (before whitening); advantages are whitened over valid tokens."""
    _check_token_inputs(token_level_rewards, response_mask)
    values = _require(values, "values (critic predictions [B, T])", "gae")
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"gae: values shape {tuple(values.shape)} != rewards shape {tuple(token_level_rewards.shape)}")
    with torch.no_grad():
        valid = response_mask.bool()
        batch, length = token_level_rewards.shape
        next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
        running = torch.zeros_like(next_value)
        advantages = torch.zeros_like(values)
        for t in reversed(range(length)):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            # A masked position leaves the recursion state untouched, so it is skipped, not an episode boundary.
            running = torch.where(valid[:, t], candidate, running)
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            advantages[:, t] = candidate
        advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
        returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_advantage("grpo", uses_groups=True)
def compute_grpo_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + eps), std unbiased; `norm_by_std=False`
    keeps only the mean baseline. Returns equal advantages (there is no critic)."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, num_groups = _group_index(group_ids, scores.shape[0], "grpo")
        size, mean, std = _group_stats(scores, index, num_groups)
        centred = scores - mean  # singleton groups: mean is the score itself, so 0
        per_seq = centred / (std + eps) if norm_by_std else centred
        per_seq = torch.where(size > 1, per_seq, torch.zeros_like(per_seq))
        advantages = _broadcast(per_seq, response_mask, token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_advantage("dr_grpo", uses_groups=True)
def compute_dr_grpo_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """Dr.GRPO (Liu et al. 2025): GRPO without the std division, whatever `norm_by_std` says. Pair it with
    `loss_agg_mode="seq-mean-token-sum-norm"` to also drop the per-sequence length normalisation."""
    return compute_grpo_advantages(
        token_level_rewards=token_level_rewards, response_mask=response_mask, group_ids=group_ids,
        norm_by_std=False, eps=eps,
    )


@register_advantage("rloo", uses_groups=True)
def compute_rloo_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the other samples of the same prompt."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, num_groups = _group_index(group_ids, scores.shape[0], "rloo")
        size, mean, _ = _group_stats(scores, index, num_groups)
        leave_one_out_mean = (mean * size - scores) / (size - 1).clamp(min=1)
        per_seq = torch.where(size > 1, scores - leave_one_out_mean, torch.zeros_like(scores))
        advantages = _broadcast(per_seq, response_mask, token_level_rewards.dtype)
    return advantages, advantages.clone()


def _discounted_returns(token_level_rewards, response_mask, gamma):
    valid = response_mask.bool()
    running = torch.zeros(
        token_level_rewards.shape[0], dtype=token_level_rewards.dtype, device=token_level_rewards.device
    )
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        candidate = token_level_rewards[:, t] + gamma * running
        running = torch.where(valid[:, t], candidate, running)
        returns[:, t] = candidate
    return torch.where(valid, returns, torch.zeros_like(returns))


@register_advantage("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over the batch's valid tokens.
    Returns are the un-whitened reward-to-go."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline", uses_groups=True)
def compute_reinforce_plus_plus_baseline_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """REINFORCE++-baseline: subtract the group-mean score per sequence, then whiten over the batch tokens."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, num_groups = _group_index(group_ids, scores.shape[0], "reinforce_plus_plus_baseline")
        size, mean, _ = _group_stats(scores, index, num_groups)
        per_seq = torch.where(size > 1, scores - mean, torch.zeros_like(scores))
        advantages = masked_whiten(_broadcast(per_seq, response_mask, torch.float64), response_mask).to(
            token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_advantage("remax")
def compute_remax_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """ReMax (Li et al. 2023): undiscounted reward-to-go minus the score of the greedy rollout of the same
    prompt (`baseline_scores` [B]). Returns are the reward-to-go."""
    _check_token_inputs(token_level_rewards, response_mask)
    baseline_scores = _require(baseline_scores, "baseline_scores (greedy-rollout score per row, [B])", "remax")
    baseline_scores = torch.as_tensor(
        baseline_scores, dtype=token_level_rewards.dtype, device=token_level_rewards.device
    )
    batch = token_level_rewards.shape[0]
    if baseline_scores.shape != (batch,):
        raise ValueError(f"remax: baseline_scores must be [B]=[{batch}], got {tuple(baseline_scores.shape)}")
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, response_mask, 1.0)
        advantages = returns - _broadcast(baseline_scores, response_mask, returns.dtype)
    return advantages, returns


@register_advantage("opo", uses_groups=True)
def compute_opo_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """OPO (Hao et al. 2025): score minus the length-weighted group mean sum(len_j * s_j) / sum(len_j), the
    optimal baseline for sequence-level rewards under token-sum losses."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, num_groups = _group_index(group_ids, scores.shape[0], "opo")
        lengths = response_mask.to(scores.dtype).sum(-1)
        size, weighted_mean, _ = _group_stats(scores, index, num_groups, weights=lengths)
        per_seq = torch.where(size > 1, scores - weighted_mean, torch.zeros_like(scores))
        advantages = _broadcast(per_seq, response_mask, token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_advantage("sppo", uses_groups=True)
def compute_sppo_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """SPPO (Wu et al. 2024, arXiv 2405.00675): each response's estimated win rate against the policy,
    ``P(y_i > pi | x) - 1/2``, from the scores of the prompt's other responses as the preference oracle (a
    higher score wins, a tie is half a win). The ``sppo`` policy loss regresses the sequence log-ratio onto
    ``eta`` times it. A lone response has no one to play: 0."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, _ = _group_index(group_ids, scores.shape[0], "sppo")
        same_group = index.unsqueeze(0) == index.unsqueeze(1)
        wins = (scores.unsqueeze(1) > scores.unsqueeze(0)).to(scores.dtype)
        wins += 0.5 * (scores.unsqueeze(1) == scores.unsqueeze(0)).to(scores.dtype)
        others = same_group & ~torch.eye(len(scores), dtype=torch.bool)
        played = others.sum(-1)
        win_rate = (wins * others).sum(-1) / played.clamp(min=1)
        per_seq = torch.where(played > 0, win_rate - 0.5, torch.zeros_like(win_rate))
        advantages = _broadcast(per_seq, response_mask, token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_advantage("spin", uses_groups=True)
def compute_spin_advantages(
    *, token_level_rewards, response_mask, group_ids=None, values=None, gamma=1.0, lam=1.0,
    norm_by_std=True, baseline_scores=None, eps=1e-6,
):
    """SPIN's preference labels (verl's recipe: online DPO): after :func:`megarl.algorithms.preference.
    preference_pair_rows` each group is one pair; its higher-scored response is chosen (+1), the other rejected
    (-1), the first of a tie chosen. The ``dpo`` policy loss reads them."""
    _check_token_inputs(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        index, num_groups = _group_index(group_ids, scores.shape[0], "spin")
        per_seq = torch.zeros_like(scores)
        for group in range(num_groups):
            rows = (index == group).nonzero().flatten().tolist()
            if len(rows) != 2:
                raise ValueError(f"spin: group {group} has {len(rows)} responses; SPIN trains on pairs (one chosen, "
                                 f"one rejected per prompt), made by preference_pair_rows")
            first, second = rows
            chosen = first if scores[first] >= scores[second] else second
            per_seq[first] = per_seq[second] = -1.0
            per_seq[chosen] = 1.0
        advantages = _broadcast(per_seq, response_mask, token_level_rewards.dtype)
    return advantages, advantages.clone()
