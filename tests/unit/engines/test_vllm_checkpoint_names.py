"""What the vLLM engine expects from a weight sync when no weights are on disk (``load_format=dummy``): the names
and shapes a checkpoint of the model would hold, which for an MoE model under transformers 5 are not the names of
its in-memory tensors (the experts are fused there). Seen on the H100: a Qwen3-MoE sync refused
``model.layers.0.mlp.experts.0.gate_proj.weight`` as unknown."""

from __future__ import annotations

import pytest
import torch

from bench.shapes import model_config


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny"])
def test_the_names_without_weights_are_those_a_checkpoint_holds(tmp_path, shape):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.engines.rollout.weight_session import read_checkpoint_shapes

    config = AutoConfig.for_model(**model_config(shape, torch_dtype="float32"))
    config.save_pretrained(tmp_path / "config_only")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), framework="pt") as handle:
        saved = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert read_checkpoint_shapes(str(tmp_path / "config_only"), weights_on_disk=False) == saved
    assert read_checkpoint_shapes(str(tmp_path / "saved")) == saved


@pytest.mark.parametrize("version,v2", [((0, 26), None), ((0, 32), "1")])
def test_routed_experts_ask_for_the_model_runner_their_vllm_serves_them_with(monkeypatch, version, v2):
    """vLLM 0.26 captures routed experts in its V1 runner and refuses V2; 0.32 serves them from V2 only."""
    import os

    from megarl.engines.rollout import vllm_compat

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: version)
    with vllm_compat.routed_experts_env(True):
        assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == v2
    with vllm_compat.routed_experts_env(False):
        assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
