"""The driver sends each worker method only the TrainBatch fields its declaration says it reads
(``@register(reads=...)``, megarl.controller.dispatch), through either kind of worker group."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megarl.batch import TrainBatch
from megarl.controller.dispatch import Collect, Dispatch, method_spec, register, ship_reads
from megarl.controller.inprocess_group import InProcessWorkerGroup
from megarl.controller.reward_model_worker import RewardModelWorker
from megarl.controller.teacher_worker import TeacherWorker
from megarl.controller.workers import ActorRolloutRefWorker, CriticWorker

BATCH_METHODS = [ActorRolloutRefWorker.compute_log_probs, ActorRolloutRefWorker.compute_ref_log_probs,
                 ActorRolloutRefWorker.update_actor, CriticWorker.compute_values, CriticWorker.update_critic,
                 RewardModelWorker.compute_rm_scores, TeacherWorker.compute_teacher_log_probs]


def full_batch(rows: int = 4) -> TrainBatch:
    tensor = torch.ones(rows, 3)
    return TrainBatch(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, 3, dtype=torch.long), response_mask=torch.ones(rows, 3, dtype=torch.long),
        group_ids=[f"g{r // 2}" for r in range(rows)], data_sources=["src"] * rows, ground_truths=["7"] * rows,
        extra_infos=[{}] * rows, rollout_log_probs=tensor, old_log_probs=tensor, ref_log_probs=tensor,
        values=tensor, token_level_scores=tensor, token_level_rewards=tensor, advantages=tensor, returns=tensor,
        rollout_is_weights=tensor, loss_mask=tensor.long(), generated_mask=tensor.long(), teacher_log_probs=tensor)


def test_every_worker_method_that_takes_a_batch_declares_what_it_reads():
    for cls in (ActorRolloutRefWorker, CriticWorker, RewardModelWorker, TeacherWorker):
        for name, method in inspect.getmembers(cls, inspect.isfunction):
            annotations = inspect.get_annotations(method)
            if any(value in ("TrainBatch", TrainBatch) for key, value in annotations.items() if key != "return"):
                assert method in BATCH_METHODS, f"{cls.__name__}.{name} takes a batch: list it above"
    for method in BATCH_METHODS:
        assert method_spec(method).reads, method.__qualname__
        assert method_spec(method).dispatch is Dispatch.DP_SPLIT, method.__qualname__


@pytest.mark.parametrize("method", BATCH_METHODS, ids=lambda m: m.__qualname__)
def test_each_method_gets_its_fields_and_nothing_else(method):
    batch = full_batch()
    (sent,), _ = ship_reads(method_spec(method), (batch,), {})
    keep = method_spec(method).reads
    for f in dataclasses.fields(sent):
        value = getattr(sent, f.name)
        if f.name in keep:
            assert value is getattr(batch, f.name), f.name  # the same tensor, not a copy
        else:
            assert value is None, f.name
    # reward inputs never travel to the ranks
    assert not {"data_sources", "ground_truths", "extra_infos", "group_ids"} & set(keep)
    assert batch.data_sources == ["src"] * 4  # the driver's batch is untouched


def test_what_is_shipped_is_what_the_losses_need():
    assert {"old_log_probs", "advantages", "ref_log_probs"} <= set(method_spec(ActorRolloutRefWorker.update_actor).reads)
    assert {"values", "returns"} <= set(method_spec(CriticWorker.update_critic).reads)


class _Echo:
    """A worker that reports which fields reached it."""

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0, reads=("prompt_ids", "advantages"))
    def present(self, batch: TrainBatch) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(batch) if getattr(batch, f.name) not in (None, []))


class _Other:
    def present(self, batch: TrainBatch) -> list[str]:
        return []


def test_a_group_ships_the_declared_fields_and_refuses_another_classs_method():
    group = InProcessWorkerGroup(_Echo, device="cpu")
    try:
        assert group.call(_Echo.present, full_batch()) == ["advantages", "prompt_ids"]
        with pytest.raises(TypeError, match="not a method of the worker class _Echo"):
            group.call(_Other.present, full_batch())
    finally:
        group.shutdown()


def test_a_declaration_naming_a_field_the_batch_lacks_fails_at_import():
    with pytest.raises(ValueError, match=r"\['advantage'\] are not TrainBatch fields"):
        register(dispatch=Dispatch.DP_SPLIT, reads=("advantage",))
