"""vLLM's own engine arguments through megarl (verl's ``actor_rollout_ref.rollout.engine_kwargs.vllm``), on the real
(CPU) vLLM: an FP8 KV cache (``kv_cache_dtype=fp8``) is what the engine a worker builds from the run config runs
with, and weight syncs through it come back exactly; an argument megarl sets itself is refused, naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megarl.engines.rollout.base import SamplingConfig  # noqa: E402
from megarl.engines.rollout.factory import build_rollout_engine  # noqa: E402
from tests.distributed.engines.rollout.tiny_model import random_hf_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]


def test_an_argument_megarl_sets_is_refused_naming_it(tiny_qwen2_dir):
    with pytest.raises(ValueError, match=r"engine arguments \['enforce_eager', 'seed'\] .*engine_kwargs.vllm"):
        build_rollout_engine("vllm", str(tiny_qwen2_dir), engine_args={"seed": 3, "enforce_eager": False})


def test_fp8_kv_cache_runs_and_weight_syncs_through_it_are_exact(tiny_qwen2_dir):
    """The engine a worker builds from the run's config (the path from the key to vLLM)."""
    from safetensors.torch import load_file

    from megarl.controller.rollout_replicas import RolloutReplica
    from megarl.controller.rollout_worker import build_rollout_engine_for
    from megarl.run_config import load_config
    from tests.paths import REPO

    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"actor_rollout_ref.model.path={tiny_qwen2_dir}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.kv_cache_memory_mb=64", "data.max_response_length=8",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8"])
    engine = build_rollout_engine_for(cfg, str(tiny_qwen2_dir), replica=RolloutReplica(index=0, size=1, group=None),
                                      colocated=False, device="cpu", local_device_index=None)
    try:
        assert engine.llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"

        def cache_dtypes(worker):
            return sorted({str(t.dtype) for t in worker.model_runner.kv_caches if isinstance(t, torch.Tensor)})

        assert engine.llm.collective_rpc(cache_dtypes)[0] in (["torch.float8_e4m3fn"], ["torch.uint8"])
        greedy = SamplingConfig.greedy(max_tokens=8, logprobs=True, ignore_eos=True)
        first = engine.generate(PROMPTS, greedy)
        original = load_file(str(tiny_qwen2_dir / "model.safetensors"))
        for state in (random_hf_state(tiny_qwen2_dir, seed=7), original):
            engine.update_weights(sorted(state.items()))
            engine.finish_weight_update()
            synced = engine.generate(PROMPTS, greedy)
        # another model's weights and then the checkpoint's again: the FP8 cache's scales and the reloaded
        # layers give back the first tokens and log-probs exactly
        assert [o.token_ids for o in synced] == [o.token_ids for o in first]
        assert [o.log_probs for o in synced] == [o.log_probs for o in first]
    finally:
        engine.shutdown()
