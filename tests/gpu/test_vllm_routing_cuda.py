"""On CUDA with real vLLM: an MoE model's routed experts come back with each sample (vLLM's
``enable_return_routed_experts``, its V2 model runner), in megarl's contract: ``[tokens, MoE layers, top-k]`` for
the prompt and response less the last token, from ``routed_experts_start`` (a prefix vLLM served from its cache is
not routed again). They are the experts the fp32 HF engine picks for the same tokens, but for near-ties that
bf16 decides otherwise. vLLM on CPU cannot return them (no Triton); tests/e2e/trainer/test_routing_replay_e2e.py
covers replay in the trainer with the HF engine.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]


def test_vllm_returns_the_routed_experts_the_hf_engine_picks():
    pytest.importorskip("vllm")
    if importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
        pytest.skip("vLLM was staged without its MoE kernels (../shared/device/vllm_prepare.sh --keep-moe)")
    from tests.dist_harness import run_distributed

    # a process of its own, as every in-process vLLM engine of tests/gpu
    assert run_distributed(_world, 1, cuda=True)[0]


def _world(rank):
    import numpy as np

    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.hf_engine import HFRolloutEngine
    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine
    from megarl.models.embedded import ensure_embedded_model

    path = str(ensure_embedded_model("tiny-qwen3-moe"))
    sampling = SamplingConfig.greedy(max_tokens=8, ignore_eos=True)
    engine = VLLMRolloutEngine(path, dtype="bfloat16", in_process=True, enforce_eager=True, max_model_len=256,
                               kv_cache_memory_bytes=1 << 30, seed=0, gpu_memory_utilization=0.2,
                               return_routed_experts=True)
    try:
        first = engine.generate(PROMPTS, sampling)
        again = engine.generate(PROMPTS, sampling)  # the prompts' blocks may now come from the prefix cache
    finally:
        engine.shutdown()
    reference = HFRolloutEngine(path, dtype="float32", device="cuda", return_routed_experts=True)
    agree = total = 0
    for outputs in (first, again):
        for prompt, out in zip(PROMPTS, outputs):
            routed = out.routed_experts
            assert routed.shape[1:] == (2, 2) and routed.dtype == np.int16
            assert out.routed_experts_start + len(routed) == len(prompt) + len(out.token_ids) - 1
            # the HF engine routes the same tokens (teacher-forced: vLLM's response as its prompt)
            tokens = prompt + out.token_ids[:-1]
            forced = reference.generate([tokens], SamplingConfig.greedy(max_tokens=1))[0].routed_experts
            mine = np.sort(forced[out.routed_experts_start:], axis=-1)
            agree += int((np.sort(routed, axis=-1) == mine).all(axis=-1).sum())
            total += routed.shape[0] * routed.shape[1]
    assert agree / total > 0.9, (agree, total)
    return True
