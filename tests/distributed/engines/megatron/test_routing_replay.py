"""MoE routing replay (R2/R3) in the megatron engines on real megatron-core over gloo, a tiny Qwen3-MoE.

One rank, padded and packed micro-batches: recording the routers' own choice and replaying it changes nothing
(bitwise); replaying other experts changes the log-probs, and a comparison-only pass reports how many
(token, layer) routings differ. An update replaying forced routing with full activation recomputation equals
the one without recomputation (the recomputed forward in the backward pass must take the same experts).
Two ranks (tensor parallel; context parallelism; pipeline stages with recomputation): what the routers
record and what replaying forced routing gives equal the one-rank world. And the HF rollout engine's routing of
its own samples, replayed in megatron, is the routing megatron chooses itself (fp32, same weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale

ROWS = 6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    # four experts of which two are routed per token: forced routing differs from the own one often
    return save_tiny_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5, num_experts=4,
                                   num_experts_per_tok=2)


def _batch(vocab: int, seed: int = 0):
    from megarl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_len, response_len = 6, 6
    prompt_lens = torch.randint(2, prompt_len + 1, (ROWS,), generator=g)
    resp_lens = torch.randint(1, response_len + 1, (ROWS,), generator=g)
    prompt_mask = (torch.arange(prompt_len)[None] >= prompt_len - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_len)[None] < resp_lens[:, None]).long()
    batch = TrainBatch(prompt_ids=torch.randint(1, vocab, (ROWS, prompt_len), generator=g) * prompt_mask,
                       prompt_mask=prompt_mask,
                       response_ids=torch.randint(1, vocab, (ROWS, response_len), generator=g) * response_mask,
                       response_mask=response_mask, group_ids=[str(i // 2) for i in range(ROWS)])
    batch.advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, response_len).clone() * response_mask
    return batch


def _forced_routing(like: torch.Tensor, num_experts: int, seed: int = 1) -> torch.Tensor:
    """Random distinct experts per (token, layer) wherever ``like`` knows the routing."""
    g = torch.Generator().manual_seed(seed)
    rows, seq, layers, top_k = like.shape
    picks = torch.rand(rows, seq, layers, num_experts, generator=g).argsort(dim=-1)[..., :top_k]
    return torch.where(like >= 0, picks, torch.full_like(picks, -1)).to(torch.int16)


def _engine(hf_dir, layout, *, packed=False, recompute=False):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.models.bridge import ModelBridge, unwrap_model
    from megarl.models.hf_checkpoint import load_hf_weights

    bridge = ModelBridge.from_hf_config(hf_dir)
    overrides = {}
    if recompute:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = bridge.transformer_config(layout=layout, params_dtype=torch.float32, **overrides)

    def provide(pre_process, post_process, vp_stage=None):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    engine = ActorEngine(model_provider=provide, config=config, optimizer_config=OptimizerConfig(lr=1e-3),
                         micro_batch_size=2, micro_batching=MicroBatching(sequence_packing=packed),
                         vocab_size=bridge.dims.vocab_size, routing_replay=True)
    load_hf_weights([unwrap_model(chunk) for chunk in engine.model], hf_dir, bridge)
    engine.optimizer.reload_model_params()
    return engine, bridge


def _passes(engine, batch, num_experts):
    own = engine.log_prob_pass(batch, record_routing=True)
    batch.routed_experts = own.routed_experts.to(torch.int16)
    same = engine.log_prob_pass(batch, replay_routing=True)
    forced_routing = _forced_routing(batch.routed_experts, num_experts)
    batch.routed_experts = forced_routing
    forced = engine.log_prob_pass(batch, replay_routing=True)
    compared = engine.log_prob_pass(batch)
    return dict(own=own, same=same, forced=forced, compared=compared, forced_routing=forced_routing)


def _one_rank(rank, hf_dir):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    layout = ParallelLayout()
    initialize_megatron_parallel(layout=layout, seed=3)
    results = {}
    for packed in (False, True):
        engine, bridge = _engine(hf_dir, layout, packed=packed)
        batch = _batch(bridge.dims.vocab_size)
        results[packed] = _passes(engine, batch, bridge.dims.num_experts)
    # an update replaying forced routing, with and without full recomputation
    updates = []
    for recompute in (False, True):
        engine, bridge = _engine(hf_dir, layout, recompute=recompute)
        batch = _batch(bridge.dims.vocab_size)
        batch.routed_experts = results[False]["forced_routing"]
        batch.old_log_probs = results[False]["forced"].log_probs
        metrics = engine.update_policy(batch, replay_routing=True)
        updates.append((metrics, engine.log_prob_pass(batch, replay_routing=True).log_probs))
    results["updates"] = updates
    return results


@pytest.fixture(scope="module")
def single(hf_dir):
    return run_distributed(_one_rank, 1, hf_dir)[0]


def test_replaying_the_own_routing_changes_nothing_and_forced_routing_is_taken(single):
    results = single
    for packed in (False, True):
        r = results[packed]
        mask = _batch(1000).response_mask.bool()  # same rows, same masks: only the vocab bound differs
        routed = r["own"].routed_experts
        assert routed.shape[2:] == (2, 2)  # two MoE layers, top-2
        real = _batch(1000).attention_mask.bool()
        assert bool((routed[real] >= 0).all()) and bool((routed[~real] == -1).all())
        assert torch.equal(r["same"].log_probs[mask], r["own"].log_probs[mask])
        assert r["same"].routing_mismatch == 0.0
        # forced experts: most (token, layer) pairs differ from what the routers pick, and the log-probs move
        assert r["forced"].routing_mismatch > 0.5
        assert r["compared"].routing_mismatch == r["forced"].routing_mismatch
        assert torch.equal(r["compared"].log_probs[mask], r["own"].log_probs[mask])
        assert (r["forced"].log_probs[mask] - r["own"].log_probs[mask]).abs().max() > 1e-3
    # the packed layout routes the same tokens the same way
    assert torch.equal(results[True]["own"].routed_experts, results[False]["own"].routed_experts)
    assert_close_to_scale(results[True]["forced"].log_probs[mask], results[False]["forced"].log_probs[mask],
                          FP32_REORDERED)
    (plain, plain_lp), (recomputed, recomputed_lp) = results["updates"]
    assert plain["grad_norm"] == pytest.approx(recomputed["grad_norm"], rel=1e-5)
    assert plain["pg_loss"] == pytest.approx(recomputed["pg_loss"], rel=1e-5, abs=1e-7)
    assert_close_to_scale(recomputed_lp[mask], plain_lp[mask], FP32_REORDERED)


def _two_ranks(rank, hf_dir, forced_routing, which):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    layout = {"tp": ParallelLayout(tensor_parallel=2), "cp": ParallelLayout(context_parallel=2),
              "pp": ParallelLayout(pipeline_parallel=2)}[which]
    initialize_megatron_parallel(layout=layout, seed=3)
    # pipeline stages run forwards ahead of backwards (1F1B): recomputation must pop its own micro-batch's routing
    engine, bridge = _engine(hf_dir, layout, packed=which == "cp", recompute=which == "pp")
    batch = _batch(bridge.dims.vocab_size)
    own = engine.log_prob_pass(batch, record_routing=True)
    batch.routed_experts = forced_routing
    forced = engine.log_prob_pass(batch, replay_routing=True)
    if which == "tp":  # megatron trains MoE with TP only under sequence parallelism, which needs TE's norms
        return dict(own=own, forced=forced)
    metrics = engine.update_policy(_with(batch, old_log_probs=forced.log_probs), replay_routing=True)
    return dict(own=own, forced=forced, grad_norm=metrics["grad_norm"])


def _with(batch, **fields):
    for name, value in fields.items():
        setattr(batch, name, value)
    return batch


@pytest.mark.parametrize("which", ["tp", "cp", "pp"])
def test_tensor_context_and_pipeline_parallel_ranks_record_and_replay_like_one_rank(hf_dir, single, which):
    one = single[False]
    ranks = run_distributed(_two_ranks, 2, hf_dir, one["forced_routing"], which)
    mask = _batch(1000).response_mask.bool()
    for result in ranks:
        assert torch.equal(result["own"].routed_experts, one["own"].routed_experts)
        assert_close_to_scale(result["forced"].log_probs[mask], one["forced"].log_probs[mask], FP32_REORDERED)
        if "grad_norm" in result:
            assert result["grad_norm"] == pytest.approx(single["updates"][0][0]["grad_norm"], rel=1e-4)
