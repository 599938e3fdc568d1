"""Actor / reference / critic engines on real megatron over gloo: PPO updates, layouts, checkpoint, offload.

World A (TP=1, 1 rank) is the reference trajectory and writes the initial weights as a dist-checkpoint;
the TP=2, PP=2 and DP=2 worlds must reproduce its log-probs, losses and updated log-probs. Weights match
across layouts because TP uses use_cpu_initialization from one seed, and PP loads A's checkpoint.
"""

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale, untimed

STEPS = 3
UPDATE = dict(mini_batch_size=4, policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28,
              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def _setup(tp=1, pp=1):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    return initialize_megatron_parallel(layout=ParallelLayout(tensor_parallel=tp, pipeline_parallel=pp), seed=3)


def _actor(tp=1, pp=1, micro_batch_size=2, lr=2e-3):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.lr_schedule import LRScheduleConfig
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    config = tiny_config(tp=tp, pp=pp)
    return ActorEngine(
        model_provider=gpt_provider(config), config=config,
        optimizer_config=OptimizerConfig(lr=lr, weight_decay=0.01, clip_grad=1.0, adam_beta2=0.99),
        lr_schedule=LRScheduleConfig(warmup_steps=2, decay_steps=10, decay_style="cosine", min_lr=1e-4),
        micro_batch_size=micro_batch_size,
    )


def _batch(rows=8):
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    batch = synthetic_batch(rows)
    batch.ref_log_probs = torch.full(batch.response_ids.shape, -4.8)
    return batch


def _train(actor, batch, steps=STEPS, between=None):
    log_probs, entropy = actor.compute_log_probs(batch)
    batch.old_log_probs = log_probs
    history = []
    for _ in range(steps):
        history.append(actor.update_policy(batch, **UPDATE))
        if between is not None:
            between()
    return log_probs, entropy, history, actor.compute_log_probs(batch)[0]


def _world_a(rank, root):
    from megarl.engines.megatron.checkpoint import save_checkpoint
    from megarl.engines.megatron.offload import offload_engine, reload_engine

    _setup()
    batch = _batch()
    actor = _actor()
    save_checkpoint(actor, root, step=0)
    result = dict(zip(("log_probs", "entropy", "history", "final_log_probs"), _train(actor, batch)))

    # The same trajectory with everything offloaded and reloaded between steps must be bit-identical.
    shadow = _actor()
    freed = []

    def offload_and_reload():
        state = offload_engine(shadow)
        freed.append(state.num_bytes)
        # Storage really released: a parameter now has no bytes behind it.
        freed.append(next(shadow.model[0].parameters()).untyped_storage().nbytes())
        # The grad buffer is dropped, not saved (it comes back zeroed): it takes no host memory
        grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in shadow.model[0].buffers)
        freed.append((grad_bytes, state.num_bytes - state.host_bytes))
        reload_engine(state)

    _, _, shadow_history, shadow_final = _train(shadow, _batch(), between=offload_and_reload)
    result.update(offload_history=shadow_history, offload_final=shadow_final, offload_bytes=freed)
    return result


def _world_tp2(rank, root):
    from megarl.engines.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megarl.engines.megatron.critic import CriticEngine
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    _setup(tp=2)
    batch = _batch()
    actor = _actor(tp=2)
    log_probs, entropy, history, final = _train(actor, batch, steps=1)
    ckpt = os.path.join(root, "tp2")
    save_checkpoint(actor, ckpt, step=1)
    params_at_save = [p.detach().clone() for p in actor.model[0].parameters()]
    after_save = [actor.update_policy(batch, **UPDATE) for _ in range(STEPS - 1)]
    after_save_lp = actor.compute_log_probs(batch)[0]

    fresh = _actor(tp=2)
    assert load_checkpoint(fresh, ckpt) == 1
    restored = [p.detach() for p in fresh.model[0].parameters()]
    params_equal = all(torch.equal(a, b) for a, b in zip(params_at_save, restored))
    resumed = [fresh.update_policy(batch, **UPDATE) for _ in range(STEPS - 1)]
    resumed_lp = fresh.compute_log_probs(batch)[0]

    from megatron.core.optimizer import OptimizerConfig

    config = tiny_config(tp=2)
    critic = CriticEngine(model_provider=gpt_provider(config), config=config,
                          optimizer_config=OptimizerConfig(lr=3e-3, clip_grad=1.0), micro_batch_size=2)
    batch.values = critic.compute_values(batch)
    values0 = batch.values.clone()
    critic_history = [critic.update_critic(batch, mini_batch_size=4, cliprange_value=10.0) for _ in range(4)]
    return dict(log_probs=log_probs, entropy=entropy, history=history + after_save, final_log_probs=after_save_lp,
                resumed=resumed, resumed_log_probs=resumed_lp, params_equal=params_equal,
                values=values0, critic_history=critic_history)


def _world_pp2(rank, root):
    from megarl.engines.megatron.actor import ReferenceEngine
    from megarl.engines.megatron.checkpoint import load_checkpoint
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    _setup(pp=2)
    batch = _batch()
    config = tiny_config(pp=2)
    reference = ReferenceEngine(model_provider=gpt_provider(config, seed=99), config=config, micro_batch_size=4)
    load_checkpoint(reference, root, step=0)
    ref_log_probs, _ = reference.compute_log_probs(batch)
    actor = _actor(pp=2)
    load_checkpoint(actor, root, step=0, load_optimizer=False)  # step 0 precedes any Adam state
    log_probs, entropy, history, final = _train(actor, batch)
    return dict(log_probs=log_probs, history=history, final_log_probs=final, ref_log_probs=ref_log_probs)


def _world_dp2(rank, root):
    from megarl.batch import select_rows

    info = _setup()
    assert info.dp_size == 2
    full = _batch()
    # Rank r holds rows {2r, 2r+1, 4+2r, 5+2r}: with 2 local rows per mini-batch the global mini-batches are
    # rows 0-3 then 4-7, exactly A's, while micro-batches are 1 row here and 2 rows in A.
    rows = [2 * info.dp_rank, 2 * info.dp_rank + 1, 4 + 2 * info.dp_rank, 5 + 2 * info.dp_rank]
    shard = select_rows(full, rows)
    actor = _actor(micro_batch_size=1)
    log_probs, _ = actor.compute_log_probs(shard)
    shard.old_log_probs = log_probs
    history = [actor.update_policy(shard, **{**UPDATE, "mini_batch_size": 2}) for _ in range(STEPS)]
    return dict(rows=rows, log_probs=log_probs, history=history, final_log_probs=actor.compute_log_probs(shard)[0])


@pytest.fixture(scope="module")
def world_a(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_distributed(_world_a, 1, root)[0]


def _assert_history_close(history, expected, keys=("pg_loss", "loss", "entropy", "kl_loss", "grad_norm", "lr")):
    assert len(history) == len(expected)
    for got, want in zip(history, expected):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), key


@pytest.mark.timeout(240)
def test_ppo_update_reduces_loss_and_offload_is_exact(world_a):
    root, a = world_a
    losses = [h["pg_loss"] for h in a["history"]]
    assert losses[-1] < losses[0] - 1e-3, losses
    mask = _batch().response_mask.bool()
    assert not torch.allclose(a["final_log_probs"][mask], a["log_probs"][mask])
    # one schedule step per update_policy call (a training step), whatever its mini-batch count: the warmup
    # starts at init_lr (0) for the whole first call, as in verl
    assert a["history"][0]["lr"] == 0 and all(0 < h["lr"] <= 2e-3 for h in a["history"][1:])
    assert a["history"][0]["lr"] < a["history"][1]["lr"] < a["history"][2]["lr"]
    assert os.path.isdir(os.path.join(root, "iter_0000000"))
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "0\n"  # Megatron-LM's tracker
    # offload: bytes moved, storage freed, and the trajectory unchanged bit for bit
    assert a["offload_bytes"][0] > 0 and a["offload_bytes"][1] == 0
    grad_bytes_left, dropped = a["offload_bytes"][2]
    assert grad_bytes_left == 0 and dropped > 0
    assert [untimed(h) for h in a["offload_history"]] == [untimed(h) for h in a["history"]]
    assert torch.equal(a["offload_final"], a["final_log_probs"])


@pytest.mark.timeout(240)
def test_tp2_matches_tp1_and_checkpoint_resume_is_exact_and_critic_learns(world_a):
    root, a = world_a
    results = run_distributed(_world_tp2, 2, root)
    for r in results:  # every rank of the replica holds the results
        assert_close_to_scale(r["log_probs"], a["log_probs"], FP32_REORDERED, "log-probs")
        assert_close_to_scale(r["entropy"], a["entropy"], FP32_REORDERED, "entropy")
        _assert_history_close(r["history"], a["history"])
        torch.testing.assert_close(r["final_log_probs"], a["final_log_probs"], rtol=1e-4, atol=1e-4)
        assert r["params_equal"]
        assert [untimed(h) for h in r["resumed"]] == [untimed(h) for h in r["history"][1:]]  # save -> load -> same
        assert torch.equal(r["resumed_log_probs"], r["final_log_probs"])
        vf = [h["vf_loss"] for h in r["critic_history"]]
        assert vf[-1] < 0.8 * vf[0], vf
    torch.testing.assert_close(results[0]["values"], results[1]["values"])


@pytest.mark.timeout(240)
def test_pp2_matches_tp1_and_reference_loads_actor_weights(world_a):
    root, a = world_a
    for r in run_distributed(_world_pp2, 2, root):
        assert_close_to_scale(r["ref_log_probs"], a["log_probs"], FP32_REORDERED, "ref log-probs")
        assert_close_to_scale(r["log_probs"], a["log_probs"], FP32_REORDERED, "log-probs")
        _assert_history_close(r["history"], a["history"])
        torch.testing.assert_close(r["final_log_probs"], a["final_log_probs"], rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(240)
def test_dp2_equals_dp1_on_the_same_global_batch(world_a):
    root, a = world_a
    results = run_distributed(_world_dp2, 2, root)
    for r in results:
        assert_close_to_scale(r["log_probs"], a["log_probs"][r["rows"]], FP32_REORDERED, "log-probs")
        # Token-mean over the global mini-batch: DP=2 x 2 micro-batches of 1 row == DP=1 x 2 micro-batches
        # of 2 rows, step by step (metrics are DP-reduced, so every rank reports the global values).
        _assert_history_close(r["history"], a["history"])
        torch.testing.assert_close(r["final_log_probs"], a["final_log_probs"][r["rows"]], rtol=1e-4, atol=1e-4)


def _world_dp2_distributed_optimizer_resume(rank, root):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.checkpoint import load_checkpoint, save_checkpoint
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    _setup()

    def build():
        config = tiny_config()
        return ActorEngine(
            model_provider=gpt_provider(config), config=config,
            optimizer_config=OptimizerConfig(lr=2e-3, clip_grad=1.0, use_distributed_optimizer=True),
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            micro_batch_size=2)

    batch = _batch()
    actor = build()
    _train(actor, batch, steps=2)
    save_checkpoint(actor, os.path.join(root, "distopt"), step=2)
    # The save runs in this process: megatron's own writer leaves a spawned multiprocessing Manager behind
    # (seconds to start inside a worker; an orphan once the worker is killed).
    import multiprocessing

    assert multiprocessing.active_children() == [], multiprocessing.active_children()
    continued = [actor.update_policy(batch, **UPDATE) for _ in range(2)]
    fresh = build()
    load_checkpoint(fresh, os.path.join(root, "distopt"))
    resumed = [fresh.update_policy(batch, **UPDATE) for _ in range(2)]
    return continued, resumed


def test_distributed_optimizer_checkpoint_resume_is_exact(tmp_path):
    for continued, resumed in run_distributed(_world_dp2_distributed_optimizer_resume, 2, str(tmp_path)):
        _assert_history_close(resumed, continued)


def _world_bf16_resume(rank, root):
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.checkpoint import load_checkpoint, save_checkpoint
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    _setup()

    def build():
        config = dataclasses.replace(tiny_config(), bf16=True, params_dtype=torch.bfloat16)
        return ActorEngine(model_provider=gpt_provider(config), config=config,
                           optimizer_config=OptimizerConfig(lr=2e-3, clip_grad=1.0, bf16=True), micro_batch_size=2)

    batch = _batch()
    actor = build()
    dtypes = {name: param.dtype for name, param in actor.model[0].named_parameters()}
    _train(actor, batch, steps=2)
    save_checkpoint(actor, os.path.join(root, "bf16"), step=2)
    continued = [actor.update_policy(batch, **UPDATE) for _ in range(2)]
    fresh = build()
    load_checkpoint(fresh, os.path.join(root, "bf16"))
    resumed = [fresh.update_policy(batch, **UPDATE) for _ in range(2)]
    return dtypes, continued, resumed


def test_bf16_model_with_the_plain_optimizer_checkpoints_and_resumes_exactly(tmp_path):
    """megatron's bf16 optimizer (fp32 main copies, not distributed) maps its state to the model's parameters by
    their order among the bf16 ones: an fp32 weight in the model (the local spec's torch norms make them) shifts
    that map, and the save failed on the GPU. Every weight is in the model's dtype, and a resume continues the
    run."""
    ((dtypes, continued, resumed),) = run_distributed(_world_bf16_resume, 1, str(tmp_path))
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    _assert_history_close(resumed, continued)
