"""Weight sync from TP/PP/EP-sharded Megatron models into the HF rollout engine, on real gloo worlds.

After changing the Megatron weights and syncing, the rollout engine's logits must equal the trainer's
logits (what Megatron itself computes), on every rank; the buckets must respect their bound.
"""

import zlib

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.distributed.models.bridge_workers import (TWO_RANK_LAYOUTS, build_chunks, forward_logits, hf_logits,
                                                     sample_tokens)

BUCKET_BYTES = 16 * 1024


# every MoE architecture: Qwen3-MoE (routed experts) and DeepSeek-V3 (MLA, shared experts, the router's
# aux-loss-free expert bias, a dense first layer), experts split over two ranks
LAYOUTS = TWO_RANK_LAYOUTS + [("deepseek_v3", dict(expert_parallel=2))]


def _perturb(chunks) -> None:
    # Noise seeded by parameter name: replicated parameters get the same noise on every TP rank. The routers'
    # expert bias (a buffer: it moves by load balancing, not by gradients) too, enough to change which experts
    # some tokens take.
    with torch.no_grad():
        for chunk in chunks:
            named = list(chunk.named_parameters()) + [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
            for name, tensor in named:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                scale = 0.5 if name.endswith("expert_bias") else 0.05
                tensor.add_(scale * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))


def _expert_biases(chunks, engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the trainer's expert bias, the rollout engine's) per MoE layer of this rank's chunks."""
    pairs = []
    for chunk in chunks:
        for name, buffer in chunk.named_buffers():
            if name.endswith("expert_bias"):
                layer = int(name.split("layers.")[1].split(".")[0])
                offset = chunk.decoder.layers[0].layer_number - 1  # this stage's first global layer
                hf = engine.model.model.layers[layer + offset].mlp.gate.e_score_correction_bias
                pairs.append((buffer.detach().float().clone(), hf.detach().float().clone()))
    return pairs


def _sync_world(rank, hf_dir, layout_kwargs):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.engines.rollout.hf_engine import HFRolloutEngine
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.weight_sync import ColocatedTransport, sync_weights

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=5)
    bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
    chunks = build_chunks(bridge, bridge.transformer_config(layout=layout))
    load_hf_weights(chunks, hf_dir, bridge)
    _perturb(chunks)
    engine = HFRolloutEngine(hf_dir)
    num_experts = bridge.dims.num_experts
    stats = sync_weights(chunks, bridge, ColocatedTransport(engine), bucket_bytes=BUCKET_BYTES,
                         num_local_experts=num_experts // layout.expert_parallel if num_experts else None)
    tokens = sample_tokens(bridge.dims.vocab_size)
    trainer_logits = forward_logits(chunks, tokens, bridge.dims.vocab_size)
    with torch.no_grad():
        rollout_logits = engine.model(input_ids=tokens).logits
    largest_tensor = max(p.numel() * p.element_size() for p in engine.model.parameters())
    return trainer_logits, rollout_logits, stats.largest_bucket_bytes, stats.num_buckets, largest_tensor, \
        stats.num_tensors, _expert_biases(chunks, engine)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch, layout", LAYOUTS)
def test_rollout_logits_equal_trainer_logits_after_sync(tmp_path, arch, layout):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = str(save_tiny_hf_checkpoint(arch, tmp_path / arch, seed=0))
    before = hf_logits(hf_dir, sample_tokens(int(__import__("json").load(open(f"{hf_dir}/config.json"))["vocab_size"])))
    results = run_distributed(_sync_world, 2, hf_dir, layout)
    trainer = [r[0] for r in results if r[0] is not None]
    assert trainer, "the last pipeline stage returns the trainer's logits"
    for trainer_logits in trainer:
        for _, rollout_logits, largest_bucket, buckets, largest_tensor, tensors, _ in results:
            torch.testing.assert_close(rollout_logits, trainer_logits, rtol=1e-4, atol=1e-4)
            assert largest_bucket <= max(BUCKET_BYTES, largest_tensor)
            assert buckets > 1
    # The sync really changed the rollout model (the trainer's weights were perturbed).
    assert (results[0][1] - before).abs().max() > 1e-2
    assert results[0][5] == results[1][5]  # every rank received the whole model
    biases = [pair for result in results for pair in result[6]]
    assert bool(biases) == (arch == "deepseek_v3")
    for trainer_bias, rollout_bias in biases:  # the perturbed expert bias itself, not only its effect
        assert torch.equal(rollout_bias, trainer_bias)


def test_bucketize_bounds_and_order():
    from megarl.weight_sync.buckets import bucketize

    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(bucketize(tensors, bucket_bytes=4 * 25))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    with pytest.raises(ValueError, match="positive"):
        list(bucketize(tensors, bucket_bytes=0))
