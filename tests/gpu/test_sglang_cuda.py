"""On CUDA with real SGLang (issue 41): megarl's SGLang engine generates, seeds per prompt, takes weight updates
from device tensors exactly (CUDA IPC into SGLang's scheduler process), and releases its memory when asleep.

One engine (bf16, sleep mode, no CUDA graphs, no radix cache: every compared generation prefills from scratch;
SGLang's deterministic mode, in which alone it honours per-request seeds) on a small random Qwen2 (4 layers, GQA); greedy decoding with log-probs is deterministic for a fixed batch, so
"exact" below means equal token ids and equal log-probs:

* generation: every prompt gets ``max_tokens`` tokens (``ignore_eos``) with finite log-probs <= 0; sampled with
  per-prompt seeds, one prompt's seed changes its samples only, the same seeds repeat them, and the n samples
  of a prompt differ from each other; a stop token id ends a sample with "stop" and stays in its tokens;
* weight update: perturbed weights (several buckets) change the output; the original weights restore it
  exactly; the perturbed ones again (other bucket bound) reproduce the first update exactly; a session missing
  a tensor is refused;
* sleep (weights backed up to the host) then wake: output unchanged and at least half of SGLang's static share
  freed; sleep, wake the weights only, push, wake the rest: the pushed weights' output.

Skipped without CUDA or without SGLang (CI; SGLang has no CPU build for these machines); run on the GPU box
after the SGLang stage (docs/sglang.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.rollout_engine_checks import (PROMPTS, check_greedy_generation, check_updates_are_exact, device_used,
                                           greedy, original_and_perturbed, push, write_model)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHARE = 0.15  # of the device, for weights and KV cache (mem_fraction_static)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen2_sglang"))


@pytest.fixture(scope="module")
def engine(model_dir):
    pytest.importorskip("sglang")
    from megarl.engines.rollout.sglang_engine import SGLangRolloutEngine

    engine = SGLangRolloutEngine(str(model_dir), dtype="bfloat16", enable_sleep_mode=True, enforce_eager=True,
                                 max_model_len=512, seed=0, gpu_memory_utilization=SHARE,
                                 enable_prefix_caching=False,
                                 server_args={"enable_deterministic_inference": True})  # SGLang's seeds need it
    assert engine.honours_seeds
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def weights(model_dir):
    return original_and_perturbed(model_dir)


def test_generation(engine):
    check_greedy_generation(engine)


def test_per_prompt_seeds_make_a_prompts_samples_its_own(engine):
    """Changing one prompt's seed changes its samples only (the batch keeps its shape, so the others' logits
    are computed alike); the n samples of a prompt differ; the same seeds give the same samples."""
    from megarl.engines.rollout.base import SamplingConfig

    def sample(seeds):
        sampling = SamplingConfig(n=3, temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=True,
                                  prompt_seeds=tuple(seeds))
        by_prompt: dict = {}
        for output in engine.generate(PROMPTS[:4], sampling):
            assert all(lp <= 0 for lp in output.log_probs)
            by_prompt.setdefault(output.prompt_index, []).append(output.token_ids)
        return by_prompt

    first = sample([100, 200, 300, 400])
    assert sample([100, 200, 300, 400]) == first
    other = sample([100, 200, 999, 400])
    assert other[2] != first[2]
    assert {i: other[i] for i in (0, 1, 3)} == {i: first[i] for i in (0, 1, 3)}
    assert len({tuple(t) for t in first[2]}) == 3, "the n samples of a prompt came out the same"


def test_a_stop_token_ends_the_sample_and_stays_in_it(engine):
    from megarl.engines.rollout.base import SamplingConfig

    first = greedy(engine)[0][0]  # ignore_eos: may pass the model's eos (id 2), which this run stops at
    before_eos = first.index(2) if 2 in first else len(first)
    assert before_eos > 0
    stop = first[min(5, before_eos - 1)]  # a token of the greedy continuation before any eos: greedy reaches it again
    outputs = engine.generate(PROMPTS, SamplingConfig.greedy(max_tokens=48, stop_token_ids=(stop,)))
    assert outputs[0].finish_reason == "stop"
    assert outputs[0].token_ids == first[:first.index(stop) + 1]


def test_device_tensor_updates_are_exact(engine, weights):
    check_updates_are_exact(engine, *weights)  # ends on the original weights


def test_a_session_missing_a_tensor_is_refused(engine, weights):
    original, _ = weights
    engine.update_weights([(name, t) for name, t in original.items() if name != "model.norm.weight"])
    with pytest.raises(RuntimeError, match="lacks 1 checkpoint tensors"):
        engine.finish_weight_update()
    engine.update_weights([("model.norm.weight", original["model.norm.weight"])])
    engine.finish_weight_update()


def test_sleep_releases_memory_and_keeps_or_takes_weights(engine, weights):
    original, perturbed = weights
    push(engine, original, bucket_bytes=8 << 20)
    reference = greedy(engine)

    awake = device_used()
    engine.sleep()
    freed = awake - device_used()
    share = SHARE * torch.cuda.get_device_properties(0).total_memory
    print(f"sleep freed {freed / 2**30:.2f} GiB of the {share / 2**30:.2f} GiB share")
    assert freed >= 0.5 * share, freed
    with pytest.raises(RuntimeError, match="asleep"):
        greedy(engine)
    engine.wake_up()
    assert greedy(engine) == reference

    engine.sleep(discard_weights=True)
    engine.wake_up(weights_only=True)
    push(engine, perturbed, bucket_bytes=8 << 20)
    engine.wake_up()
    pushed = greedy(engine)
    push(engine, perturbed, bucket_bytes=20 << 20)
    assert greedy(engine) == pushed != reference
