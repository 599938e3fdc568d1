"""vLLM rollout engine on the real (CPU) vLLM: sampling shape, greedy and log-prob equivalence with the HF
engine, bucketed weight updates (incl. the prefix-cache reset), input validation and the CPU sleep refusal.

One engine is started for the whole module (~30 s); the tests share it and run in file order, the weight
update test last-but-validation so the earlier tests see the original weights.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("vllm")

from megarl.engines.rollout.base import SamplingConfig  # noqa: E402
from megarl.engines.rollout.factory import build_rollout_engine  # noqa: E402
from megarl.engines.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from tests.distributed.engines.rollout.reference_decoding import score_response  # noqa: E402
from tests.distributed.engines.rollout.tiny_model import copy_model_with_state, random_hf_state  # noqa: E402

# Generous: engine start is ~35 s alone but took 125 s while other jobs shared the 2 cores.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
# 70 tokens = two full 32-token KV blocks that vLLM's prefix cache keeps between calls.
LONG_PROMPT = [2 + (7 * i) % 40 for i in range(70)]


@pytest.fixture(scope="module")
def vllm_engine(tiny_qwen2_dir):
    engine = build_rollout_engine(
        "vllm", str(tiny_qwen2_dir), dtype="float32", enforce_eager=True, max_model_len=128,
        gpu_memory_utilization=0.3, kv_cache_memory_bytes=64 << 20, block_size=32, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_engine(tiny_qwen2_dir):
    return HFRolloutEngine(str(tiny_qwen2_dir))


def assert_greedy_match(vllm_outputs, hf_outputs, atol=1e-3):
    for v, h in zip(vllm_outputs, hf_outputs, strict=True):
        match = next((i for i, (a, b) in enumerate(zip(v.token_ids, h.token_ids)) if a != b),
                     min(len(v.token_ids), len(h.token_ids)))
        assert v.token_ids == h.token_ids, f"prompt {v.prompt_index}: tokens agree for the first {match} only"
        assert v.finish_reason == h.finish_reason
        torch.testing.assert_close(torch.tensor(v.log_probs), torch.tensor(h.log_probs), atol=atol, rtol=0)


def test_n_samples_grouped_and_max_tokens(vllm_engine):
    sampling = SamplingConfig(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True, logprobs=True)
    outputs = vllm_engine.generate(PROMPTS, sampling)
    assert [o.prompt_index for o in outputs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in outputs)
    assert all(len(o.log_probs) == 6 for o in outputs)
    assert vllm_engine.generate(PROMPTS, sampling) == outputs  # seeded: reproducible
    assert len({tuple(o.token_ids) for o in outputs[:3]}) > 1  # the n samples are not copies


def test_greedy_matches_hf_engine(vllm_engine, hf_engine):
    sampling = SamplingConfig.greedy(max_tokens=12, logprobs=True)
    prompts = PROMPTS + [LONG_PROMPT]
    assert_greedy_match(vllm_engine.generate(prompts, sampling), hf_engine.generate(prompts, sampling))


def test_sampled_log_probs_match_hf_scoring(vllm_engine, hf_engine):
    sampling = SamplingConfig(n=2, temperature=0.8, max_tokens=8, seed=1, logprobs=True, ignore_eos=True)
    for out in vllm_engine.generate(PROMPTS, sampling):
        expected = score_response(hf_engine.model, PROMPTS[out.prompt_index], out.token_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(expected), atol=1e-3, rtol=0)


def test_stop_strings_and_stop_ids_match_hf_engine(vllm_engine, hf_engine):
    (greedy,) = hf_engine.generate([PROMPTS[1]], SamplingConfig.greedy(max_tokens=12))
    text = hf_engine._load_tokenizer().decode(greedy.token_ids, skip_special_tokens=True)
    for sampling in (SamplingConfig.greedy(max_tokens=12, stop=[text[3:5]], logprobs=True),
                     SamplingConfig.greedy(max_tokens=12, stop_token_ids=[greedy.token_ids[4]], logprobs=True)):
        v, h = vllm_engine.generate([PROMPTS[1]], sampling), hf_engine.generate([PROMPTS[1]], sampling)
        assert v[0].finish_reason == "stop"
        assert_greedy_match(v, h)


def test_prompt_seeds_make_each_prompts_samples_independent_of_the_rest_of_the_call(vllm_engine):
    from dataclasses import replace

    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, prompt_seeds=(5, 9, 13))
    together = vllm_engine.generate(PROMPTS, sampling)
    alone = vllm_engine.generate(PROMPTS[1:2], replace(sampling, prompt_seeds=(9,)))
    assert [o.token_ids for o in alone] == [o.token_ids for o in together[2:4]]
    assert together[2].token_ids != together[3].token_ids


def test_agent_loop_conversations_hold_the_tool_results_they_were_generated_after(vllm_engine, hf_engine, tmp_path):
    """Multi-turn rollouts through vLLM: calculator results between the turns (forced calls), each later turn
    sampled after them (teacher-forced HF log-probs of the whole sequence equal vLLM's per turn)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megarl.data.tokenizer import write_local_tokenizer
    from tests.distributed.agents.conversation_checks import generate_and_check

    chat_tokenizer = AutoTokenizer.from_pretrained(str(write_local_tokenizer(tmp_path / "chat")))
    tools = Path(__file__).resolve().parents[4] / "configs" / "tools" / "calculator_python.yaml"
    generate_and_check(vllm_engine, hf_engine.model, chat_tokenizer, tools, atol=1e-3)


def test_sleep_is_refused_on_cpu(vllm_engine, tiny_qwen2_dir):
    assert not vllm_engine.supports_sleep
    with pytest.raises(NotImplementedError, match="CPU"):
        vllm_engine.sleep()
    with pytest.raises(NotImplementedError, match="not supported by vLLM on CPU"):
        build_rollout_engine("vllm", str(tiny_qwen2_dir), enable_sleep_mode=True)


def test_update_weights_in_buckets_matches_fresh_hf_model(vllm_engine, tiny_qwen2_dir, tmp_path):
    greedy = SamplingConfig.greedy(max_tokens=12, logprobs=True)
    prompts = PROMPTS + [LONG_PROMPT]
    before = vllm_engine.generate(prompts, greedy)  # also fills the prefix cache for LONG_PROMPT

    new_state = random_hf_state(tiny_qwen2_dir, seed=7)
    items = sorted(new_state.items())
    buckets = [items[start:start + 5] for start in range(0, len(items), 5)]  # q/k/v of a layer get split
    for bucket in buckets[:-1]:
        vllm_engine.update_weights(bucket)
    with pytest.raises(RuntimeError, match="finish_weight_update"):
        vllm_engine.generate(prompts, greedy)
    # An incomplete session would rebuild half-loaded fused modules from garbage: it must be refused
    # and stay open until the rest arrives.
    with pytest.raises(RuntimeError, match=rf"lacks {len(buckets[-1])} checkpoint tensors"):
        vllm_engine.finish_weight_update()
    vllm_engine.update_weights(buckets[-1])
    with pytest.raises(ValueError, match="sent twice"):
        vllm_engine.update_weights(buckets[-1][:1])
    vllm_engine.finish_weight_update()
    assert vllm_engine.weight_reload_taken == "layerwise"  # CPU GEMMs are re-packed after loading: not direct

    fresh = HFRolloutEngine(str(copy_model_with_state(tiny_qwen2_dir, tmp_path / "new", new_state)))
    after = vllm_engine.generate(prompts, greedy)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert_greedy_match(after, fresh.generate(prompts, greedy))

    sampling = SamplingConfig(temperature=0.8, max_tokens=8, seed=2, logprobs=True, ignore_eos=True)
    for out in vllm_engine.generate(prompts, sampling):
        expected = score_response(fresh.model, prompts[out.prompt_index], out.token_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(expected), atol=1e-3, rtol=0)


def test_unknown_weight_reload_mode_is_refused_before_the_engine_starts(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="weight_reload='fast' is not one of"):
        build_rollout_engine("vllm", str(tiny_qwen2_dir), weight_reload="fast")


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_a_vision_language_model_without_torchvision_is_refused_by_name_before_the_engine_starts():
    """vLLM's Qwen2.5-VL imports transformers' torchvision image processor; without it vLLM fails deep in its
    model inspection. The engine names the package first (CPU builds here have none: the path runs on the GPU,
    tests/gpu/test_vllm_vision_language_cuda.py)."""
    from megarl.models.embedded import resolve_model_path

    with pytest.raises(ModuleNotFoundError, match="vision-language model and vLLM.s image processing needs torchvision"):
        build_rollout_engine("vllm", str(resolve_model_path("embedded:tiny-qwen2-vl")))


def test_update_weights_rejects_bad_names_and_shapes(vllm_engine):
    with pytest.raises(KeyError, match="model.layers.5.self_attn.q_proj.weight"):
        vllm_engine.update_weights([("model.layers.5.self_attn.q_proj.weight", torch.zeros(128, 128))])
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight'"):
        vllm_engine.update_weights([("model.norm.weight", torch.zeros(7))])
    # Nothing was sent, so no session is open and generation still works.
    assert len(vllm_engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=2))) == 1
