"""Build a rollout engine by name; the backends are imported only when asked for (the HF engine never
imports vLLM or SGLang)."""

from __future__ import annotations

from megarl.engines.rollout.base import RolloutEngine


def build_rollout_engine(name: str, model_path: str, **kwargs) -> RolloutEngine:
    """Construct the engine called `name` ("hf", "vllm" or "sglang") for the HF checkpoint directory `model_path`."""
    if name == "hf":
        from megarl.engines.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model_path, **kwargs)
    if name == "vllm":
        from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, **kwargs)
    if name == "sglang":
        from megarl.engines.rollout.sglang_engine import SGLangRolloutEngine

        return SGLangRolloutEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; expected 'hf', 'vllm' or 'sglang'")
