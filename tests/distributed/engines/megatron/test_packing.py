"""Sequence packing (thd) and token-budget micro-batches: planning, layout, and equality with padded rows.

The engine tests run real megatron over gloo: the packed engine (and the packed engine grouping rows by a
token budget) must give the padded engine's log-probs, entropy, values, losses and updated weights, at
TP=1, TP=2 and PP=2.
"""

import pytest
import torch

from tests.numerics import untimed

from megarl.engines.megatron.packing import plan_fixed_rows, plan_token_budget, restore_row_order
from tests.dist_harness import run_distributed

UPDATE = dict(mini_batch_size=4, policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28,
              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
              loss_agg_mode="seq-mean-token-mean")


# ---------------------------------------------------------------------------------------------- planning

def test_token_budget_bins_respect_the_budget_cover_every_row_once_and_balance():
    lengths = [30, 5, 17, 40, 8, 8, 25, 12, 3, 33]
    plan = plan_token_budget(lengths, 64)
    assert sorted(r for b in plan for r in b) == list(range(len(lengths)))
    loads = [sum(lengths[r] for r in b) for b in plan]
    assert max(loads) <= 64
    assert len(plan) == 3  # 181 tokens need at least ceil(181 / 64) = 3 bins, and 3 suffice here
    assert max(loads) - min(loads) <= 12  # longest-first keeps them close
    assert plan == plan_token_budget(lengths, 64)  # deterministic
    assert all(b == sorted(b) for b in plan) and [b[0] for b in plan] == sorted(b[0] for b in plan)


def test_token_budget_grows_the_bin_count_when_ceil_does_not_fit_and_honours_multiples():
    # 3 x 40 tokens fit no two to a bin of 64: ceil(120/64) = 2 bins is not enough
    assert len(plan_token_budget([40, 40, 40], 64)) == 3
    plan = plan_token_budget([10] * 12, 64, multiple_of=4)
    assert len(plan) == 4 and all(len(b) == 3 for b in plan)


def test_token_budget_rejects_a_row_longer_than_the_budget_naming_it():
    with pytest.raises(ValueError, match=r"row 2 has 70 tokens.*max_tokens_per_micro_batch=64"):
        plan_token_budget([10, 20, 70], 64)
    with pytest.raises(ValueError, match="empty batch"):
        plan_token_budget([], 64)


def test_fixed_rows_and_row_order_restore():
    assert plan_fixed_rows(6, 2) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="micro_batch_size=4"):
        plan_fixed_rows(6, 4)
    mbs = [{"rows": [1, 3]}, {"rows": [0, 2]}]
    parts = [torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [2.0]])]
    assert restore_row_order(parts, mbs).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------- layout

def test_pack_rows_layout_points_every_response_token_at_the_logit_that_predicts_it():
    from megarl.engines.megatron.packing import pack_rows
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    batch = synthetic_batch(rows=5, seed=3)
    rows = [4, 0, 2]
    mb = pack_rows(batch, rows, ("advantages",), "cpu", multiple_of=8)
    real = batch.attention_mask[rows].sum(1)
    total = int(real.sum())
    stream = mb["input_ids"][0]
    assert stream.shape[0] == -(-total // 8) * 8
    cu = mb["packed_seq_params"].cu_seqlens_q.tolist()
    assert cu[: len(rows) + 1] == [0] + real.cumsum(0).tolist()
    assert cu[-1] == stream.shape[0] and mb["packed_seq_params"].max_seqlen_q == max(cu[i + 1] - cu[i]
                                                                                       for i in range(len(cu) - 1))
    for i, row in enumerate(rows):  # each segment is the row's real tokens, positions from 0
        seg = slice(cu[i], cu[i + 1])
        assert stream[seg].tolist() == batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert mb["position_ids"][0, seg].tolist() == list(range(cu[i + 1] - cu[i]))
    # the token after each indexed position is the response token it predicts
    targets = batch.response_ids[rows][batch.response_mask[rows].bool()]
    assert torch.equal(stream[mb["response_index"] + 1], targets)
    assert mb["advantages"].shape == batch.response_ids[rows].shape


def test_packed_causal_attention_equals_masked_attention_per_row():
    import torch.nn.functional as F

    from megarl.models.sdpa_attention import packed_causal_attention

    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    q = torch.randn(17, 4, 8, generator=g)
    k, v = torch.randn(17, 2, 8, generator=g), torch.randn(17, 2, 8, generator=g)
    out = packed_causal_attention(q, k, v, cu, max(lengths), scale=0.3)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].repeat_interleave(2, dim=1).transpose(0, 1)
        vs = v[start:end].repeat_interleave(2, dim=1).transpose(0, 1)
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[start:end], want)


# ---------------------------------------------------------------------------------------------- engines

def _engines(tp, pp, sp):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.critic import CriticEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(tensor_parallel=tp, pipeline_parallel=pp), seed=3)

    def build(kind, micro_batching):
        config = tiny_config(tp=tp, pp=pp)
        config.sequence_parallel = sp
        engine = ActorEngine if kind == "actor" else CriticEngine
        return engine(model_provider=gpt_provider(config, sdpa=True), config=config,
                      optimizer_config=OptimizerConfig(lr=2e-3, clip_grad=1.0), micro_batch_size=2,
                      micro_batching=micro_batching)

    layouts = {"padded": MicroBatching(), "packed": MicroBatching(sequence_packing=True),
               "budget": MicroBatching(sequence_packing=True, max_tokens_per_micro_batch=20)}
    return build, layouts


def _world(rank, tp, pp, sp):
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    build, layouts = _engines(tp, pp, sp)
    out = {}
    for name, micro_batching in layouts.items():
        batch = synthetic_batch(rows=8, seed=5)
        batch.ref_log_probs = torch.full(batch.response_ids.shape, -4.8)
        actor = build("actor", micro_batching)
        log_probs, entropy = actor.compute_log_probs(batch)
        batch.old_log_probs = log_probs
        history = [actor.update_policy(batch, **UPDATE) for _ in range(2)]
        critic = build("critic", micro_batching)
        batch.values = critic.compute_values(batch)
        critic_history = [critic.update_critic(batch, mini_batch_size=4) for _ in range(2)]
        out[name] = dict(log_probs=log_probs, entropy=entropy, history=history,
                         final=actor.compute_log_probs(batch)[0], values=batch.values,
                         critic_history=critic_history, mask=batch.response_mask.bool())
    return out


def _assert_layouts_agree(results):
    for r in results:
        padded = r["padded"]
        mask = padded["mask"]
        for name in ("packed", "budget"):
            got = r[name]
            for key in ("log_probs", "entropy", "final", "values"):
                torch.testing.assert_close(got[key][mask], padded[key][mask], rtol=1e-4, atol=1e-5,
                                           msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
                assert torch.all(got[key][~mask] == 0), (name, key)  # packed leaves padding slots at zero
            for hist in ("history", "critic_history"):
                for step_got, step_want in zip(got[hist], padded[hist]):
                    for metric, value in untimed(step_want).items():
                        assert step_got[metric] == pytest.approx(value, rel=2e-4, abs=2e-6), (name, hist, metric)
        # the update moved the policy, so agreement above is not agreement of two no-ops
        assert not torch.allclose(padded["final"][mask], padded["log_probs"][mask])


@pytest.mark.timeout(300)
def test_packed_and_token_budget_engines_equal_padded_tp1():
    _assert_layouts_agree(run_distributed(_world, 1, 1, 1, False))


@pytest.mark.timeout(300)
def test_packed_and_token_budget_engines_equal_padded_tp2():
    # (sequence parallelism needs the TE/apex norms: the local spec's torch norm refuses it)
    _assert_layouts_agree(run_distributed(_world, 2, 2, 1, False))


@pytest.mark.timeout(300)
def test_packed_and_token_budget_engines_equal_padded_pp2():
    _assert_layouts_agree(run_distributed(_world, 2, 1, 2, False))
