"""On CUDA with real vLLM: ``load_format=dummy`` (what ``actor.load_weight=false`` runs with) starts from a
directory that holds config.json only; the engine knows every tensor name and shape from the config (a meta-device
model), refuses a weight session that lacks some, and after the trainer's weights arrive it scores like them.

Written after the 2026-12-06 stay (the 7B run exercised this path on the H100 through bench/e2e_grpo.py
--random-init); to run in the next stay with ``bash bench/run_device.sh validate``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.rollout_engine_checks import CONFIG, PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_dummy_weights_are_replaced_by_the_trainers_and_score_like_them(tmp_path):
    pytest.importorskip("vllm")
    from tests.dist_harness import run_distributed

    # a process of its own: an in-process vLLM engine started earlier in this pytest process (test_vllm_cuda.py)
    # leaves a torch.distributed world behind, which would make this engine take the external launcher
    assert run_distributed(_world, 1, str(tmp_path), cuda=True)[0]


def _world(rank, model_dir):
    from pathlib import Path

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine
    from megarl.weight_sync.buckets import bucketize

    tmp_path = Path(model_dir)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    trainer_model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16).cuda().eval()
    weights = {name: t.detach() for name, t in trainer_model.state_dict().items()}
    engine = VLLMRolloutEngine(str(tmp_path), dtype="bfloat16", in_process=True, enforce_eager=True,
                               max_model_len=512, kv_cache_memory_bytes=1 << 30, seed=0, gpu_memory_utilization=0.2,
                               enable_prefix_caching=False, load_format="dummy")
    try:
        assert set(engine._checkpoint_shapes) == set(weights)  # from the config alone
        buckets = list(bucketize(sorted(weights.items()), 8 << 20))
        for bucket in buckets[:-1]:
            engine.update_weights(bucket)
        with pytest.raises(RuntimeError, match="lacks"):
            engine.finish_weight_update()  # a session without the last bucket would leave dummy weights behind
        engine.update_weights(buckets[-1])  # the session stays open: the rest completes it
        engine.finish_weight_update()
        sampling = SamplingConfig.greedy(max_tokens=1, logprobs=True, ignore_eos=True)
        outputs = engine.generate(PROMPTS[:4], sampling)
        for prompt, output in zip(PROMPTS[:4], outputs):
            with torch.no_grad():
                logits = trainer_model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            reference = torch.log_softmax(logits, -1)
            assert output.token_ids[0] == int(reference.argmax())
            # bf16 weights and activations in two implementations: a few bf16 ulps of a log-prob of ~-8
            assert abs(output.log_probs[0] - float(reference.max())) < 0.1, (output.log_probs[0], float(reference.max()))
        return True
    finally:
        engine.shutdown()
