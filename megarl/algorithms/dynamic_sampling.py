"""DAPO's dynamic sampling and overlong reward shaping: pure functions over group ids and scores.

* :func:`rows_of_informative_groups`: a group whose responses all scored the same gives every one of
  them a zero group-relative advantage, so it spends compute and dilutes the token-mean loss without
  teaching anything; dynamic sampling keeps only the groups with a score spread and generates more
  batches until enough remain.
* :func:`overlong_penalty`: a soft penalty for responses that run into the last ``buffer_length`` tokens
  of the length limit, growing linearly to ``-penalty_factor`` at the limit (truncated answers are
  usually wrong for another reason than their content).
"""

from __future__ import annotations

from typing import Sequence

import torch


def rows_of_informative_groups(group_ids: Sequence[str], scores: torch.Tensor, *, tolerance: float = 0.0) -> list[int]:
    """Rows (in order) of the groups whose scores are not all equal (max - min > ``tolerance``)."""
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {scores.shape[0]} scores")
    spread: dict[str, tuple[float, float]] = {}
    for group, score in zip(group_ids, scores.tolist()):
        low, high = spread.get(group, (score, score))
        spread[group] = (min(low, score), max(high, score))
    informative = {group for group, (low, high) in spread.items() if high - low > tolerance}
    return [row for row, group in enumerate(group_ids) if group in informative]


def first_groups(group_ids: Sequence[str], count: int) -> list[int]:
    """Rows of the first ``count`` distinct groups, in order of first appearance."""
    chosen: dict[str, None] = {}
    rows = []
    for row, group in enumerate(group_ids):
        if group not in chosen:
            if len(chosen) == count:
                continue
            chosen[group] = None
        rows.append(row)
    return rows


def overlong_penalty(response_lengths: torch.Tensor, *, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """``[B]`` penalties (<= 0): 0 up to ``max_response_length - buffer_length`` tokens, then falling
    linearly to ``-penalty_factor`` at ``max_response_length``."""
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in (0, max_response_length={max_response_length}], "
                         f"got {buffer_length}")
    excess = response_lengths.float() - (max_response_length - buffer_length)
    return (-excess / buffer_length * penalty_factor).clamp(max=0.0)
