"""A per-token loss mask with holes inside responses (multi-turn: tool results between the model's turns)
through the actor's update, padded and packed, with context parallelism, in every loss aggregation mode:

- what the masked tokens hold does not matter: advantages of 1e3 there give the same updated model as the
  advantages the unmasked tokens have;
- the first step's policy loss is the fp64 aggregation over the unmasked tokens alone (ratio 1 there:
  pg_loss = agg(-A)), so masked tokens are out of the token and sequence counts too.
"""

import pytest
import torch

from tests.dist_harness import run_distributed

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def holes(response_mask: torch.Tensor) -> torch.Tensor:
    """response_mask with a tool-result-like hole after each response's first two tokens (where long enough)."""
    mask = response_mask.clone()
    mask[:, 2:4] = 0
    return mask


def reference_pg_loss(advantages: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int) -> float:
    a, m = advantages.double(), mask.double()
    per_row = (-a * m).sum(-1)
    lengths = m.sum(-1)
    rows = float((lengths > 0).sum())
    if mode == "token-mean":
        return float(per_row.sum() / m.sum())
    if mode == "seq-mean-token-sum":
        return float(per_row.sum() / rows)
    if mode == "seq-mean-token-mean":
        return float((per_row / lengths.clamp(min=1)).sum() / rows)
    return float(per_row.sum() / (rows * norm_length))


def _world(rank, cp):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(context_parallel=cp), seed=3)
    layouts = {"padded": MicroBatching(), "packed": MicroBatching(sequence_packing=True)}

    def build(micro_batching):
        config = tiny_config()
        config.context_parallel_size = cp
        return ActorEngine(model_provider=gpt_provider(config, sdpa=True), config=config,
                           optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=0.0), micro_batch_size=2,
                           micro_batching=micro_batching)

    out = {}
    for layout, micro_batching in layouts.items():
        for mode in MODES:
            batch = synthetic_batch(rows=8, seed=5)
            g = torch.Generator().manual_seed(9)
            batch.advantages = torch.randn(batch.response_ids.shape, generator=g) * batch.response_mask
            batch.loss_mask = holes(batch.response_mask)
            poisoned = torch.where(batch.loss_mask.bool(), batch.advantages,
                                   1e3 * torch.randn(batch.response_ids.shape, generator=g))
            clean = batch.advantages
            finals, losses = [], []
            for advantages in (clean, poisoned):
                actor = build(micro_batching)
                batch.old_log_probs = actor.compute_log_probs(batch)[0]
                batch.advantages = advantages
                metrics = actor.update_policy(batch, loss_agg_mode=mode, norm_length=batch.response_ids.shape[1])
                finals.append(actor.compute_log_probs(batch)[0])
                losses.append(metrics["pg_loss"])
            out[(layout, mode)] = dict(finals=finals, losses=losses, start=batch.old_log_probs,
                                       advantages=clean,
                                       loss_mask=batch.loss_mask, response_mask=batch.response_mask,
                                       width=batch.response_ids.shape[1])
    return out


def _check(results):
    for result in results:
        for (layout, mode), r in result.items():
            label = f"{layout} {mode}"
            clean, poisoned = r["finals"]
            real = r["response_mask"].bool()
            assert torch.equal(clean[real], poisoned[real]), f"{label}: masked advantages changed the update"
            assert not torch.allclose(clean[real], r["start"][real]), f"{label}: the update did not move"
            want = reference_pg_loss(r["advantages"], r["loss_mask"], mode, r["width"])
            for got in r["losses"]:
                assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (label, got, want)


@pytest.mark.timeout(400)
def test_loss_mask_holes_leave_the_update_and_the_counts_with_context_parallelism():
    _check(run_distributed(_world, 2, 2, timeout_s=380))
