"""LoRA in the Megatron actor on real megatron over gloo: a zero-B adapter is the base model exactly, only the
adapters train (the base bit-for-bit unchanged, the optimizer holds the adapters alone), the adapters switched
off give the base policy (the reference), the merged weight gives the adapted model's log-probs, TP=2 reproduces TP=1, and an adapters-only checkpoint resumes exactly."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale

UPDATE = dict(mini_batch_size=4, policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28,
              entropy_coeff=0.01)
STEPS = 3


def _spec(**overrides):
    from megarl.models.lora import LoRASpec

    return LoRASpec(**{"rank": 4, "alpha": 8.0, "init_seed": 5, **overrides})


def _setup(tp=1):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    initialize_megatron_parallel(layout=ParallelLayout(tensor_parallel=tp), seed=3)


def _actor(*, tp=1, lora=None, lr=5e-3, recompute=False):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    config = tiny_config(tp=tp)
    if recompute:  # what the trainer builds for recompute_granularity=full: every layer recomputed on its own
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    return ActorEngine(model_provider=gpt_provider(config), config=config, micro_batch_size=2, lora=lora,
                       optimizer_config=OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0))


def _batch():
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    return synthetic_batch(8)


def _train(actor, batch, steps=STEPS):
    batch.old_log_probs = actor.compute_log_probs(batch)[0]
    return [actor.update_policy(batch, **UPDATE) for _ in range(steps)]


def _world_tp1(rank, root):
    from megarl.engines.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megarl.models.lora import adapters_disabled, is_adapter_param, iter_adapters

    _setup()
    batch = _batch()
    plain = _actor()
    base_log_probs = plain.compute_log_probs(batch)[0]

    actor = _actor(lora=_spec())
    zero_b_log_probs = actor.compute_log_probs(batch)[0]
    named = dict(actor.model[0].module.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    optimizer_params = [p for group in actor.optimizer.param_groups for p in group["params"]]
    history = _train(actor, batch, steps=1)
    save_checkpoint(actor, os.path.join(root, "tp1"), step=1)
    history += [actor.update_policy(batch, **UPDATE) for _ in range(STEPS - 1)]
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    trained_log_probs = actor.compute_log_probs(batch)[0]
    with adapters_disabled(actor.model):
        disabled_log_probs = actor.compute_log_probs(batch)[0]

    # the merged weights in a model without adapters give the adapted model's log-probs
    merged = {f"{name}.weight": module.adapter.merged(module.weight.detach()) for _, name, module in
              iter_adapters(actor.model)}
    plain = _actor()
    with torch.no_grad():
        for name, param in plain.model[0].module.named_parameters():
            if name in merged:
                param.copy_(merged[name])
    merged_log_probs = plain.compute_log_probs(batch)[0]

    resumed = _actor(lora=_spec())
    assert load_checkpoint(resumed, os.path.join(root, "tp1")) == 1
    resumed_history = [resumed.update_policy(batch, **UPDATE) for _ in range(STEPS - 1)]
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "tp1")) for f in fs]
    return dict(
        base_log_probs=base_log_probs, zero_b_log_probs=zero_b_log_probs, history=history,
        changed=sorted(changed), adapter_names=sorted(n for n in named if is_adapter_param(n)),
        optimizer_holds_adapters_only=len(optimizer_params) == sum(is_adapter_param(n) for n in named)
        and all(p.requires_grad for p in optimizer_params),
        trained_log_probs=trained_log_probs, disabled_log_probs=disabled_log_probs, merged_log_probs=merged_log_probs,
        resumed_history=resumed_history, checkpoint_bytes=sum(os.path.getsize(f) for f in files),
        model_bytes=sum(p.numel() * 4 for p in named.values()),
        adapted=[name for _, name, _ in iter_adapters(actor.model)])


def _world_recomputed(rank):
    _setup()
    batch = _batch()
    actor = _actor(lora=_spec(), recompute=True)
    history = _train(actor, batch)
    return dict(history=history, final_log_probs=actor.compute_log_probs(batch)[0])


def _world_tp2(rank):
    _setup(tp=2)
    batch = _batch()
    actor = _actor(tp=2, lora=_spec())
    history = _train(actor, batch)
    return dict(history=history, final_log_probs=actor.compute_log_probs(batch)[0])


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return run_distributed(_world_tp1, 1, str(tmp_path_factory.mktemp("lora")))[0]


@pytest.mark.timeout(300)
def test_lora_trains_the_adapters_only_and_switches_off_to_the_base(tp1):
    assert torch.equal(tp1["zero_b_log_probs"], tp1["base_log_probs"])  # B = 0: the base model exactly
    assert len(tp1["adapted"]) == 2 * 4  # two layers x linear_qkv, linear_proj, linear_fc1, linear_fc2
    assert tp1["changed"] and set(tp1["changed"]) <= set(tp1["adapter_names"])
    assert {n for n in tp1["adapter_names"] if n.endswith("lora_B")} <= set(tp1["changed"])
    assert tp1["optimizer_holds_adapters_only"]
    assert tp1["history"][-1]["pg_loss"] < tp1["history"][0]["pg_loss"]
    assert torch.equal(tp1["disabled_log_probs"], tp1["base_log_probs"])  # the reference: adapters off
    assert (tp1["trained_log_probs"] - tp1["base_log_probs"]).abs().max() > 1e-2  # the adapters did move it
    assert_close_to_scale(tp1["merged_log_probs"], tp1["trained_log_probs"], FP32_REORDERED, "merged weights")


@pytest.mark.timeout(300)
def test_adapter_checkpoint_is_small_and_resumes_exactly(tp1):
    assert tp1["checkpoint_bytes"] < tp1["model_bytes"] / 2  # adapters and their Adam state, not the base
    for got, want in zip(tp1["resumed_history"], tp1["history"][1:], strict=True):
        for key in ("pg_loss", "grad_norm", "entropy"):
            assert got[key] == want[key], key


@pytest.mark.timeout(300)
def test_tp2_equals_tp1(tp1):
    results = run_distributed(_world_tp2, 2)
    assert_close_to_scale(results[0]["final_log_probs"], results[1]["final_log_probs"], 0.0, "TP ranks agree")
    for got, want in zip(results[0]["history"], tp1["history"], strict=True):
        for key in ("pg_loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), key


@pytest.mark.timeout(300)
def test_recomputed_layers_train_their_adapters_as_stored_ones_do(tp1):
    # the frozen embedding's output needs no gradient: without megarl asking for one, a recomputed layer cut its
    # adapters off from the loss and LoRA trained nothing under recompute_granularity=full (grad_norm 0)
    (result,) = run_distributed(_world_recomputed, 1)
    for got, want in zip(result["history"], tp1["history"], strict=True):
        for key in ("pg_loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert (result["final_log_probs"] - tp1["base_log_probs"]).abs().max() > 1e-2
