"""Packed (thd) micro-batches give the padded rows' log-probs for every supported architecture, built through
the bridge on the local spec: GQA + q/k/v bias (Qwen2), q/k norms (Qwen3), MoE routing (Qwen3-MoE) and MLA
with YaRN RoPE and MoE (DeepSeek-V3), whose RoPE takes megatron's per-sequence ``thd`` path. With context
parallelism (CP=2 over two gloo ranks) both layouts give the CP=1 log-probs too, with MoE routing and with
MLA's YaRN RoPE."""

import pytest
import torch

from megarl.models.tiny import TINY_ARCHS
from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale


def _log_probs_both_ways(rank, arch, cp=1):
    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.tiny import tiny_hf_config
    from tests.distributed.engines.megatron.tiny_setup import synthetic_batch

    layout = ParallelLayout(context_parallel=cp)
    initialize_megatron_parallel(layout=layout, seed=3)
    bridge = ModelBridge.from_hf_config(tiny_hf_config(arch), spec="local")
    config = bridge.transformer_config(layout=layout)

    def provider(pre_process, post_process, vp_stage=None):
        torch.manual_seed(7)  # the same random weights on every rank and world size
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process)

    engine = ActorEngine(model_provider=provider, config=config, micro_batch_size=2,
                         vocab_size=bridge.dims.vocab_size)
    batch = synthetic_batch(rows=6, seed=2)
    out = {"mask": batch.response_mask.bool(), "norms": _norm_types(engine.model)}
    for name, micro_batching in (("padded", MicroBatching()), ("packed", MicroBatching(True, 24))):
        engine.micro_batching = micro_batching
        out[name] = engine.compute_log_probs(batch)[0]
    return out


def _norm_types(chunks) -> dict:
    from collections import Counter

    return dict(Counter(type(m).__name__ for chunk in chunks for m in chunk.modules() if "Norm" in type(m).__name__))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_packed_log_probs_equal_padded_for_every_architecture(arch):
    out = run_distributed(_log_probs_both_ways, 1, arch, timeout_s=180)[0]
    # the bridge fused every RMSNorm of the local spec (layers, q/k and MLA latent norms, the final one)
    assert out["norms"].get("FusedRMSNorm", 0) > 0 and "RMSNorm" not in out["norms"], out["norms"]
    mask = out["mask"]
    assert out["padded"][mask].std() > 0  # real, varied log-probs, not a constant
    assert_close_to_scale(out["packed"][mask], out["padded"][mask], FP32_REORDERED, "packed vs padded")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # the dense GQA path: test_context_parallel.py
def test_context_parallel_log_probs_equal_cp1_with_moe_and_mla(arch):
    want = run_distributed(_log_probs_both_ways, 1, arch, 1, timeout_s=180)[0]
    mask = want["mask"]
    for rank, got in enumerate(run_distributed(_log_probs_both_ways, 2, arch, 2, timeout_s=240)):
        for name in ("padded", "packed"):
            torch.testing.assert_close(got[name][mask], want["padded"][mask], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"cp=2 rank {rank} {n}: {m}")
