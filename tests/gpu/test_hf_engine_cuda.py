"""HF rollout engine on a GPU: sleep moves the weights to the host and frees their device memory; wake-up brings
them back and a bucketed weight update still finds every name."""

import pytest
import torch

from megarl.engines.rollout.base import SamplingConfig
from megarl.engines.rollout.hf_engine import HFRolloutEngine
from tests.distributed.engines.rollout.tiny_model import build_tiny_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


def test_sleep_releases_cuda_memory_and_wake_restores(tiny_qwen2_dir):
    engine = HFRolloutEngine(str(tiny_qwen2_dir), device="cuda")
    assert engine.supports_sleep
    (before,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=8, logprobs=True))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.sleep()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert torch.cuda.memory_allocated() <= held - weight_bytes
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.wake_up()
    new_norm = torch.full_like(engine.model.model.norm.weight, 1.5)
    engine.update_weights([("model.norm.weight", new_norm)])  # the name map must survive the round trip
    engine.finish_weight_update()
    assert torch.equal(engine.model.model.norm.weight, new_norm)
    engine.update_weights([("model.norm.weight", torch.ones_like(new_norm))])
    engine.finish_weight_update()
    (after,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=8, logprobs=True))
    assert after.token_ids == before.token_ids

