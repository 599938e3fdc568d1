"""HF rollout engine: sampling limits, stops, seeding, log-probs, greedy vs an independent argmax decoder,
bucketed weight updates vs a freshly loaded model, sleep/wake semantics on CPU."""

from __future__ import annotations

import math

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.engines.rollout.base import SamplingConfig
from megarl.engines.rollout.factory import build_rollout_engine
from megarl.engines.rollout.hf_engine import HFRolloutEngine, process_logits
from tests.distributed.engines.rollout.reference_decoding import greedy_decode, score_response
from tests.distributed.engines.rollout.tiny_model import copy_model_with_state, random_hf_state

PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]  # different lengths exercise left padding

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return HFRolloutEngine(str(tiny_qwen2_dir))


@pytest.fixture(scope="module")
def reference_model(tiny_qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()


def test_n_samples_grouped_by_prompt_and_max_tokens(engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=5, seed=0, ignore_eos=True, logprobs=True)
    outputs = engine.generate(PROMPTS, sampling)
    assert [o.prompt_index for o in outputs] == [0, 0, 1, 1, 2, 2]
    for out in outputs:
        assert len(out.token_ids) == 5 and out.finish_reason == "length"
        assert len(out.log_probs) == 5 and all(lp <= 0.0 for lp in out.log_probs)
    assert all(o.log_probs is None for o in engine.generate(PROMPTS, SamplingConfig.greedy(max_tokens=2)))


def test_greedy_equals_independent_argmax_decoding(engine, reference_model):
    outputs = engine.generate(PROMPTS, SamplingConfig.greedy(max_tokens=12, n=2))
    for out in outputs:
        expected = greedy_decode(reference_model, PROMPTS[out.prompt_index], 12, eos_ids={1})
        assert out.token_ids == expected
    # The tiny model must not collapse to one token, or this test would not see position bugs.
    assert len(set(outputs[0].token_ids)) > 2


def test_sampled_log_probs_match_teacher_forced_scores(engine, reference_model):
    sampling = SamplingConfig(n=2, temperature=0.7, max_tokens=8, seed=3, logprobs=True, ignore_eos=True)
    for out in engine.generate(PROMPTS, sampling):
        expected = score_response(reference_model, PROMPTS[out.prompt_index], out.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(expected), atol=1e-4, rtol=1e-4)


def test_top_k_log_probs_are_renormalized_over_the_kept_tokens(engine, reference_model):
    sampling = SamplingConfig(temperature=1.5, top_k=3, max_tokens=6, seed=1, logprobs=True, ignore_eos=True)
    (out,) = engine.generate([PROMPTS[0]], sampling)
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.no_grad():
        logits = reference_model(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 : -1] / 1.5
    top3 = torch.topk(logits, 3, dim=-1)
    for t, token in enumerate(out.token_ids):
        assert token in top3.indices[t].tolist()
        expected = F.log_softmax(top3.values[t], dim=-1)[top3.indices[t].tolist().index(token)]
        assert math.isclose(out.log_probs[t], float(expected), abs_tol=1e-4)


def test_process_logits_top_p_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    processed = process_logits(probs.log(), SamplingConfig(temperature=1.0, top_p=0.7))
    # 0.5 alone is below 0.7, 0.5+0.3 reaches it: keep the first two, renormalized to 0.625 / 0.375.
    torch.testing.assert_close(processed.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    greedy = process_logits(probs.log(), SamplingConfig.greedy(max_tokens=1))
    torch.testing.assert_close(greedy.exp(), probs)


def test_same_seed_same_output_different_seed_differs(engine):
    def run(seed):
        sampling = SamplingConfig(n=3, temperature=2.0, max_tokens=10, seed=seed, ignore_eos=True)
        return [o.token_ids for o in engine.generate(PROMPTS, sampling)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_prompt_seeds_make_each_prompts_samples_independent_of_the_rest_of_the_call(engine):
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=True,
                              prompt_seeds=(5, 9, 13))
    together = engine.generate(PROMPTS, sampling)
    alone = engine.generate(PROMPTS[1:2], replace(sampling, prompt_seeds=(9,)))
    assert [o.token_ids for o in alone] == [o.token_ids for o in together[2:4]]
    assert together[2].token_ids != together[3].token_ids  # sample j of a prompt has seed + j
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(PROMPTS, replace(sampling, prompt_seeds=(1, 2)))


def test_stop_token_ids_and_model_eos(engine, tiny_qwen2_dir, tmp_path):
    (greedy,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=12))
    stop = greedy.token_ids[3]
    cut = greedy.token_ids.index(stop) + 1
    (out,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=12, stop_token_ids=[stop]))
    assert out.token_ids == greedy.token_ids[:cut] and out.finish_reason == "stop"

    # The same token declared as the model's eos in its config must stop generation too.
    state = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    eos_dir = copy_model_with_state(tiny_qwen2_dir, tmp_path / "eos", state, eos_token_id=stop)
    (out,) = HFRolloutEngine(str(eos_dir)).generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=12))
    assert out.token_ids == greedy.token_ids[:cut] and out.finish_reason == "stop"
    (ignored,) = HFRolloutEngine(str(eos_dir)).generate(
        [PROMPTS[0]], SamplingConfig.greedy(max_tokens=12, ignore_eos=True))
    assert ignored.token_ids == greedy.token_ids


def test_stop_strings_use_the_tokenizer(engine, tiny_qwen2_dir):
    (greedy,) = engine.generate([PROMPTS[1]], SamplingConfig.greedy(max_tokens=12))
    text = AutoTokenizer.from_pretrained(str(tiny_qwen2_dir)).decode(greedy.token_ids, skip_special_tokens=True)
    stop = text[2:4]
    expected_chars = text.index(stop) + len(stop)  # one char per token in the char tokenizer
    (out,) = engine.generate([PROMPTS[1]], SamplingConfig.greedy(max_tokens=12, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[:expected_chars]


def test_update_weights_in_buckets_matches_fresh_model(tiny_qwen2_dir, tmp_path):
    engine = HFRolloutEngine(str(tiny_qwen2_dir))
    probe = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = engine.model(input_ids=probe).logits.clone()
    new_state = random_hf_state(tiny_qwen2_dir, seed=7)
    items = sorted(new_state.items())
    for start in range(0, len(items), 4):  # several bounded buckets
        engine.update_weights(items[start:start + 4])
    engine.finish_weight_update()

    fresh = AutoModelForCausalLM.from_pretrained(
        str(copy_model_with_state(tiny_qwen2_dir, tmp_path / "fresh", new_state)), dtype=torch.float32).eval()
    with torch.no_grad():
        after = engine.model(input_ids=probe).logits
        expected = fresh(input_ids=probe).logits
    assert not torch.allclose(before, after)
    assert torch.equal(after, expected)
    (out,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=8))
    assert out.token_ids == greedy_decode(fresh, PROMPTS[0], 8, eos_ids={1})


def test_update_weights_tied_embeddings(tiny_tied_qwen2_dir):
    engine = HFRolloutEngine(str(tiny_tied_qwen2_dir))
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    new_embed = torch.randn_like(engine.model.model.embed_tokens.weight)
    engine.update_weights([("lm_head.weight", new_embed)])  # trainers may export the tied head name
    engine.finish_weight_update()
    assert torch.equal(engine.model.model.embed_tokens.weight, new_embed)
    engine.update_weights([("model.embed_tokens.weight", new_embed * 2)])
    engine.finish_weight_update()
    assert torch.equal(engine.model.lm_head.weight, new_embed * 2)


def test_update_weights_rejects_bad_names_and_shapes(tiny_qwen2_dir):
    engine = HFRolloutEngine(str(tiny_qwen2_dir))
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight'"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(RuntimeError, match="finish_weight_update"):
        engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=1))
    engine.finish_weight_update()
    with pytest.raises(RuntimeError, match="without a preceding update_weights"):
        engine.finish_weight_update()


def test_sleep_wake_on_cpu_keeps_weights_and_blocks_use(tiny_qwen2_dir):
    engine = build_rollout_engine("hf", str(tiny_qwen2_dir))
    assert not engine.supports_sleep  # CPU: nothing to release, documented no-op
    (before,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=6))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=6))
    engine.wake_up()
    (after,) = engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=6))
    assert before.token_ids == after.token_ids
    engine.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        engine.generate([PROMPTS[0]], SamplingConfig.greedy(max_tokens=6))


def test_bad_inputs_raise_clear_errors(engine):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        engine.generate([[2], []], SamplingConfig.greedy(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] has invalid token id 999"):
        engine.generate([[2, 999]], SamplingConfig.greedy(max_tokens=1))
    with pytest.raises(ValueError, match="SamplingConfig.top_k"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="SamplingConfig.top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="SamplingConfig.max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ValueError, match="unknown rollout engine 'trtllm'"):
        build_rollout_engine("trtllm", "/nonexistent")
