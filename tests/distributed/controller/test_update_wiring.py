"""Every field of the actor update crosses the driver -> worker -> engine edge: through the driver's facade
(``ActorRolloutRef.update``), the batch shipping (``update_actor``'s declared reads), the worker group, the worker and its
update arguments into the Megatron engine. With lr = 0 the model never moves, so the same call gives the same
metrics, and a field perturbed alone must change them: a field dropped or replaced anywhere on the way changes
nothing. (The same at the engine alone, and every loss option: tests/distributed/engines/megatron/
test_loss_wiring.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from megarl.batch import TrainBatch
from megarl.controller.dispatch import method_spec
from megarl.controller.roles import start_workers
from megarl.controller.workers import ActorRolloutRefWorker
from megarl.run_config import load_config
from tests.distributed.engines.megatron.test_loss_wiring import IMAGES_REFUSED, _perturbed
from tests.numerics import untimed
from tests.paths import REPO

ROWS, PROMPT, RESPONSE = 32, 32, 8


def _batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(4, PROMPT + 1, (ROWS,), generator=g)
    response_lens = torch.randint(2, RESPONSE + 1, (ROWS,), generator=g)
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_lens[:, None]).long()
    return TrainBatch(prompt_ids=torch.randint(3, 60, (ROWS, PROMPT), generator=g) * prompt_mask,
                      prompt_mask=prompt_mask, response_mask=response_mask,
                      response_ids=torch.randint(3, 60, (ROWS, RESPONSE), generator=g) * response_mask,
                      group_ids=[str(i // 8) for i in range(ROWS)])


@pytest.mark.timeout(300)
def test_each_shipped_field_reaches_the_engine_through_the_driver(tmp_path):
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        "trainer.backend=inprocess", f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.actor.optim.lr=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true", f"data.max_response_length={RESPONSE}",
        # an MoE policy replaying the rollout's routing (R3): the routing is a shipped field too
        "actor_rollout_ref.model.path=embedded:tiny-qwen3-moe", "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
    workers = start_workers(cfg, total_steps=1)
    try:
        batch = _batch()
        g = torch.Generator().manual_seed(1)
        experts = torch.rand(ROWS, PROMPT + RESPONSE, 2, 8, generator=g).argsort(dim=-1)[..., :2]
        known = batch.attention_mask.bool()[..., None, None]
        batch.routed_experts = torch.where(known, experts, torch.full_like(experts, -1)).to(torch.int16)
        log_probs = workers.actor.compute_log_probs(batch).log_probs
        batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=g)
        batch.ref_log_probs = workers.actor.compute_ref_log_probs(batch)
        batch.advantages = torch.randn(ROWS, 1, generator=g).expand_as(log_probs).contiguous()
        batch.rollout_is_weights = 0.5 + torch.rand(log_probs.shape, generator=g)
        batch.loss_mask = batch.response_mask.clone()
        batch.loss_mask[::2, 1] = 0
        base = workers.actor.update(batch)
        again = workers.actor.update(batch)
        assert untimed(again) == untimed(base)  # lr = 0: only the inputs move the metrics (wall time aside)
        unmoved = []
        # the teachers' log-probs need distillation's teacher groups, which the in-process backend cannot hold:
        # tests/e2e/trainer/test_distillation_e2e.py takes them through the driver
        for field in set(method_spec(ActorRolloutRefWorker.update_actor).reads) - {"teacher_log_probs"}:
            if field == "multi_modal_inputs":  # images reach a text model's engine, which refuses them
                with pytest.raises(Exception, match=re.escape(IMAGES_REFUSED)):
                    workers.actor.update(_perturbed(batch, field))
                continue
            metrics = workers.actor.update(_perturbed(batch, field))
            if all(abs(metrics.get(k, 0.0) - base[k]) <= 1e-6 * max(1.0, abs(base[k])) for k in ("pg_loss", "kl_loss", "grad_norm")):
                unmoved.append(field)
        assert unmoved == [], f"fields that did not reach the loss through the driver and the worker: {unmoved}"
    finally:
        workers.shutdown()
