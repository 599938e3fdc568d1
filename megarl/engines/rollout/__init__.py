"""Rollout engines: the `RolloutEngine` interface (base), the HF/torch reference engine and the vLLM engine.

Importing this package does not import vLLM; `build_rollout_engine("vllm", ...)` does, lazily.
"""

from megarl.engines.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig
from megarl.engines.rollout.factory import build_rollout_engine

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingConfig", "build_rollout_engine"]
