"""The planner's rollout engine with FP8: ``rollout.quantization=fp8`` holds the weights in one byte each, an FP8
KV cache (``rollout.engine_kwargs.vllm.kv_cache_dtype=fp8``) one byte per cached value, so the engine's share of the
GPU holds twice the tokens."""

import json

import pytest

from bench.shapes import qwen2_config
from megarl.plan.from_config import specs_from_run_config
from megarl.plan.memory import plan_layout
from megarl.run_config import load_config
from tests.paths import REPO

R = "actor_rollout_ref.rollout"


def _report(tmp_path, *overrides):
    (tmp_path / "config.json").write_text(json.dumps(qwen2_config("7b")))
    config = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"actor_rollout_ref.model.path={tmp_path}", f"{R}.name=vllm", f"{R}.dtype=bfloat16", "trainer.device=cuda",
        f"{R}.gpu_memory_utilization=0.5", *overrides])
    hf_config, layout, training = specs_from_run_config(config)
    return plan_layout(hf_config, layout, training, 80.0)


def _engine(report, name):
    return next(v for k, v in next(p for p in report.phases if p.phase == "rollout").components.items() if name in k)


def test_fp8_weights_and_kv_cache_in_the_rollout_engine(tmp_path):
    bf16 = _report(tmp_path)
    fp8 = _report(tmp_path, f"{R}.quantization=fp8")
    fp8_kv = _report(tmp_path, f"{R}.quantization=fp8", f"{R}.engine_kwargs.vllm.kv_cache_dtype=fp8")
    assert _engine(fp8, "weights") == pytest.approx(_engine(bf16, "weights") / 2)
    # the weights' saving goes to the KV cache (the engine's share is fixed), and FP8 values halve each token
    assert fp8.rollout_kv_tokens_capacity > bf16.rollout_kv_tokens_capacity
    assert fp8_kv.rollout_kv_tokens_capacity == pytest.approx(2 * fp8.rollout_kv_tokens_capacity, rel=1e-6)
