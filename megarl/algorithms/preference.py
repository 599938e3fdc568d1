"""Online preference pairs from scored responses (SPIN as verl's recipe runs it, online DPO): of each prompt's
responses the highest-scored is chosen and the lowest-scored of the others rejected (the first on a tie, as
verl's argmax/argmin pick), so every prompt gives one pair whatever its scores."""

from __future__ import annotations

from typing import Sequence

import torch


def preference_pair_rows(group_ids: Sequence, scores: torch.Tensor) -> list[int]:
    """Row indices ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``, groups in first-seen order; a group needs
    at least two responses."""
    groups: dict = {}
    for row, group in enumerate(group_ids):
        groups.setdefault(group, []).append(row)
    rows: list[int] = []
    for group, members in groups.items():
        if len(members) < 2:
            raise ValueError(f"preference pairs: group {group!r} has {len(members)} response; a pair needs "
                             f"actor_rollout_ref.rollout.n >= 2")
        values = [float(scores[row]) for row in members]
        chosen = members[max(range(len(members)), key=lambda i: (values[i], -i))]
        others = [row for row in members if row != chosen]
        rejected = min(others, key=lambda row: (float(scores[row]), members.index(row)))
        rows += [chosen, rejected]
    return rows
