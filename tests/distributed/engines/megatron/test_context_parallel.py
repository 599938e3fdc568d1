"""Context parallelism: the layout math, and engines at CP=2 (real megatron over gloo) equal to CP=1.

Each engine test trains an actor and a critic for two steps from the same weights at CP=1 and at CP>1
(padded rows, packed rows, packed rows under a token budget) and compares log-probs, entropy, values,
every reported metric and the log-probs after the updates (so the gradients agree too)."""

import pytest
import torch

from tests.numerics import untimed

from megarl.engines.megatron.packing import shard_for_context_parallel
from megarl.models.context_parallel import chunk_positions, gathered_to_global, local_positions
from tests.dist_harness import run_distributed

UPDATE = dict(mini_batch_size=4, policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28,
              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
              loss_agg_mode="token-mean")


# ---------------------------------------------------------------------------------------------- layout

def test_chunks_are_megatrons_load_balanced_split():
    # 16 tokens, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        chunk_positions(10, 2, 0)


def test_megatron_rope_selects_the_same_chunks():
    from megarl.models.cpu_compat import _cpu_pos_emb_on_this_cp_rank

    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    emb = torch.arange(24.0)[:, None, None, None]  # [s, 1, 1, d]: position as the value
    for cp in (2, 3):
        for rank in range(cp):
            got = _cpu_pos_emb_on_this_cp_rank(emb, 0, Group(cp, rank)).flatten()
            assert got.tolist() == chunk_positions(24, cp, rank).float().tolist()


@pytest.mark.parametrize("cp", [2, 3])
def test_gathering_every_ranks_tokens_restores_the_stream(cp):
    bounds = (0, 12, 24, 36) if cp == 3 else (0, 8, 20, 24)  # segments, each a multiple of 2 * cp
    stream = torch.arange(bounds[-1]) * 10
    gathered = torch.cat([stream[local_positions(bounds, cp, rank)] for rank in range(cp)])
    assert torch.equal(gathered[gathered_to_global(bounds, cp)], stream)
    # every segment's tokens stay within the segment on every rank
    for rank in range(cp):
        mine = local_positions(bounds, cp, rank)
        per_segment = [((mine >= a) & (mine < b)).sum().item() for a, b in zip(bounds[:-1], bounds[1:])]
        assert per_segment == [(b - a) // cp for a, b in zip(bounds[:-1], bounds[1:])]


def test_shard_pads_rows_and_takes_labels_before_the_split():
    from megarl.engines.megatron.packing import pad_rows
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    batch = synthetic_batch(rows=2, seed=1, prompt_len=5, response_len=4)  # S = 9 -> 12 for cp=2
    mb = pad_rows(batch, [0, 1], (), "cpu")
    shards = [shard_for_context_parallel(mb, 2, rank) for rank in range(2)]
    assert [s["input_ids"].shape for s in shards] == [torch.Size([2, 6])] * 2
    assert shards[0]["cp_bounds"] == (0, 12)
    for rank, shard in enumerate(shards):
        positions = chunk_positions(12, 2, rank)
        full = torch.cat([mb["input_ids"], mb["input_ids"].new_zeros(2, 3)], dim=1)
        assert torch.equal(shard["input_ids"], full[:, positions])
        next_token = torch.cat([full[:, 1:], full.new_zeros(2, 1)], dim=1)
        assert torch.equal(shard["labels"], next_token[:, positions])
        assert shard["attention_mask"].shape == (2, 1, 6, 12)
        # the added columns are masked for every query
        assert shard["attention_mask"][..., 9:].all()


# ---------------------------------------------------------------------------------------------- engines

def _world(rank, tp, cp, prompt_len, response_len, layouts=("padded", "packed", "budget")):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.critic import CriticEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(tensor_parallel=tp, context_parallel=cp), seed=3)
    choices = {"padded": MicroBatching(), "packed": MicroBatching(sequence_packing=True),
               "budget": MicroBatching(sequence_packing=True, max_tokens_per_micro_batch=24 // cp)}
    out = {}
    for name in layouts:
        micro_batching = choices[name]
        def build(engine):
            config = tiny_config(tp=tp)
            config.context_parallel_size = cp
            return engine(model_provider=gpt_provider(config, sdpa=True), config=config,
                          optimizer_config=OptimizerConfig(lr=2e-3, clip_grad=1.0), micro_batch_size=2,
                          micro_batching=micro_batching)

        batch = synthetic_batch(rows=8, seed=5, prompt_len=prompt_len, response_len=response_len)
        batch.ref_log_probs = torch.full(batch.response_ids.shape, -4.8)
        actor = build(ActorEngine)
        log_probs, entropy = actor.compute_log_probs(batch)
        batch.old_log_probs = log_probs
        history = [actor.update_policy(batch, **UPDATE) for _ in range(2)]
        critic = build(CriticEngine)
        batch.values = critic.compute_values(batch)
        critic_history = [critic.update_critic(batch, mini_batch_size=4) for _ in range(2)]
        out[name] = dict(log_probs=log_probs, entropy=entropy, history=history,
                         tokens_per_rank=sum(mb["input_ids"].numel() for mb in actor.make_micro_batches(batch)),
                         final=actor.compute_log_probs(batch)[0], values=batch.values,
                         critic_history=critic_history, mask=batch.response_mask.bool())
    return out


def _assert_equal_runs(got: dict, want: dict, label: str, cp: int):
    for layout, expected in want.items():
        mask = expected["mask"]
        # each rank ran its share of the tokens (its share of the rows rounded up to multiples of 2 * cp)
        assert expected["tokens_per_rank"] / cp <= got[layout]["tokens_per_rank"] < expected["tokens_per_rank"]
        for key in ("log_probs", "entropy", "final", "values"):
            torch.testing.assert_close(got[layout][key][mask], expected[key][mask], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=key, n=layout: f"{label} {n} {k}: {m}")
        for hist in ("history", "critic_history"):
            for step_got, step_want in zip(got[layout][hist], expected[hist]):
                for metric, value in untimed(step_want).items():
                    assert step_got[metric] == pytest.approx(value, rel=2e-4, abs=2e-6), (label, layout, metric)
        assert not torch.allclose(expected["final"][mask], expected["log_probs"][mask])  # the update moved it


@pytest.mark.timeout(400)
def test_cp2_engines_equal_cp1():
    # P + R = 11: padded rows are extended to 12 columns; packed segments are padded to multiples of 4
    (reference,) = run_distributed(_world, 1, 1, 1, 5, 6)
    for rank, got in enumerate(run_distributed(_world, 2, 1, 2, 5, 6)):
        _assert_equal_runs(got, reference, f"cp=2 rank {rank}", cp=2)


@pytest.mark.timeout(500)
def test_tp2_cp2_engines_equal_tp1_cp1():
    (reference,) = run_distributed(_world, 1, 1, 1, 6, 6, ("packed",))
    results = run_distributed(_world, 4, 2, 2, 6, 6, ("packed",), timeout_s=450)
    for rank, got in enumerate(results):
        _assert_equal_runs(got, reference, f"tp=2 cp=2 rank {rank}", cp=2)
