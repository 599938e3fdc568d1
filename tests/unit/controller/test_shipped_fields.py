"""The driver sends each worker method only the TrainBatch fields it reads (megarl.controller.roles)."""

from __future__ import annotations

import dataclasses

import torch

from megarl.batch import TrainBatch
from megarl.controller.roles import SHIPPED_FIELDS, shipped


def full_batch(rows: int = 4) -> TrainBatch:
    tensor = torch.ones(rows, 3)
    return TrainBatch(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, 3, dtype=torch.long), response_mask=torch.ones(rows, 3, dtype=torch.long),
        group_ids=[f"g{r // 2}" for r in range(rows)], data_sources=["src"] * rows, ground_truths=["7"] * rows,
        extra_infos=[{}] * rows, rollout_log_probs=tensor, old_log_probs=tensor, ref_log_probs=tensor,
        values=tensor, token_level_scores=tensor, token_level_rewards=tensor, advantages=tensor, returns=tensor)


def test_each_method_gets_its_fields_and_nothing_else():
    batch = full_batch()
    for method, keep in SHIPPED_FIELDS.items():
        sent = shipped(batch, method)
        for f in dataclasses.fields(sent):
            value = getattr(sent, f.name)
            if f.name in keep:
                assert value is getattr(batch, f.name), (method, f.name)  # the same tensor, not a copy
            else:
                assert value is None, (method, f.name)
    # reward inputs never travel to the ranks
    assert not any({"data_sources", "ground_truths", "extra_infos", "group_ids"} & set(keep)
                   for keep in SHIPPED_FIELDS.values())
    assert batch.data_sources == ["src"] * 4  # the driver's batch is untouched


def test_what_is_shipped_is_what_the_engines_require():
    assert {"old_log_probs", "advantages", "ref_log_probs"} <= set(SHIPPED_FIELDS["update_actor"])
    assert {"values", "returns"} <= set(SHIPPED_FIELDS["update_critic"])
