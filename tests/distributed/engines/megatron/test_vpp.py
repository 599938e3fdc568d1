"""ActorEngine with virtual pipeline stages (PP=2, VPP=2) reproduces the PP=1 engine, update for update.

Both worlds load the same 4-layer tiny HF checkpoints (Llama, and Qwen2 with tied embeddings, whose
embedding and output layer then sit in different chunks of different ranks) through the bridge and
``load_hf_weights``. The PP=1 world (1 rank) is the reference; the interleaved world (2 ranks, two chunks
of one layer each per rank) must give the same log-probs and entropy, the same loss / grad_norm / lr for
each PPO step (micro-batches of 2 rows, 2 or 4 micro-batches per schedule, a multiple of PP), and the same
log-probs after the updates. A micro-batch count the interleaved schedule cannot run is refused up front.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale

ARCHS = ("llama", "qwen2")
STEPS = 2
UPDATE = dict(mini_batch_size=4, policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28,
              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def _batch():
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    batch = synthetic_batch(8)  # token ids < 128, inside the tiny models' vocabulary of 250
    batch.ref_log_probs = torch.full(batch.response_ids.shape, -4.8)
    return batch


def _actor(bridge, layout, hf_dir):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.lr_schedule import LRScheduleConfig
    from megarl.models.hf_checkpoint import load_hf_weights

    config = bridge.transformer_config(layout=layout, perform_initialization=False)

    def provide(pre_process, post_process, vp_stage):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                  vp_stage=vp_stage)

    actor = ActorEngine(
        model_provider=provide, config=config,
        optimizer_config=OptimizerConfig(lr=2e-3, weight_decay=0.01, clip_grad=1.0, adam_beta2=0.99),
        lr_schedule=LRScheduleConfig(warmup_steps=1, decay_steps=10, decay_style="cosine", min_lr=1e-4),
        micro_batch_size=2, vocab_size=bridge.dims.vocab_size,
    )
    load_hf_weights([chunk.module for chunk in actor.model], hf_dir, bridge)
    actor.optimizer.reload_model_params()
    return actor


def _world(rank, hf_dirs: dict, layout_kwargs: dict):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=3)
    results = {}
    for arch, hf_dir in hf_dirs.items():
        bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
        actor = _actor(bridge, layout, hf_dir)
        batch = _batch()
        log_probs, entropy = actor.compute_log_probs(batch)
        batch.old_log_probs = log_probs
        history = [actor.update_policy(batch, **UPDATE) for _ in range(STEPS)]
        final = actor.compute_log_probs(batch)[0]
        refused = None
        if layout.virtual_pipeline_parallel:
            try:  # 8 rows in one micro-batch: fewer micro-batches than pipeline stages
                actor.compute_log_probs(batch, micro_batch_size=8)
            except ValueError as err:
                refused = str(err)
        results[arch] = dict(log_probs=log_probs, entropy=entropy, history=history, final_log_probs=final,
                             num_chunks=len(actor.model), refused=refused)
    return results


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("vpp_engine")
    hf_dirs = {arch: save_tiny_hf_checkpoint(arch, root / arch, seed=5, num_hidden_layers=4) for arch in ARCHS}
    reference = run_distributed(_world, 1, hf_dirs, dict(), timeout_s=200)[0]
    vpp = run_distributed(_world, 2, hf_dirs, dict(pipeline_parallel=2, virtual_pipeline_parallel=2),
                          timeout_s=200)
    return reference, vpp


@pytest.mark.timeout(420)
@pytest.mark.parametrize("arch", ARCHS)
def test_vpp_actor_matches_pp1(worlds, arch):
    reference, vpp = worlds
    ref = reference[arch]
    mask = _batch().response_mask.bool()
    # The updates moved the policy, so agreeing on the final log-probs is not agreeing on the start.
    assert (ref["final_log_probs"][mask] - ref["log_probs"][mask]).abs().max() > 1e-3
    assert ref["num_chunks"] == 1
    for r in vpp:  # every rank of the replica holds the results
        assert r[arch]["num_chunks"] == 2
        assert_close_to_scale(r[arch]["log_probs"], ref["log_probs"], FP32_REORDERED, f"{arch} log-probs")
        assert_close_to_scale(r[arch]["entropy"], ref["entropy"], FP32_REORDERED, f"{arch} entropy")
        assert len(r[arch]["history"]) == STEPS
        for got, want in zip(r[arch]["history"], ref["history"]):
            for key in ("pg_loss", "loss", "entropy", "kl_loss", "grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), key
        torch.testing.assert_close(r[arch]["final_log_probs"], ref["final_log_probs"], rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(420)
def test_vpp_refuses_fewer_micro_batches_than_stages(worlds):
    _, vpp = worlds
    for r in vpp:
        message = r["llama"]["refused"]
        assert message is not None and "micro_batch_size" in message and "pipeline_parallel=2" in message, message
