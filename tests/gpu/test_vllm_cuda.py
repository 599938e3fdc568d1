"""On CUDA with real vLLM: the rollout engine megarl's workers build (engine core in process) generates, takes
weight updates as device tensors exactly, and releases its memory when asleep.

One in-process engine (bf16, sleep mode, eager) on a small random Qwen2 (4 layers, head_dim 64, GQA);
greedy decoding with log-probs is deterministic for a fixed batch, so "exact" below means equal token ids and
equal log-probs (bitwise):

* generation: every prompt gets ``max_tokens`` tokens (``ignore_eos``) with finite log-probs;
* weight update: pushing perturbed weights (CUDA tensors, several buckets; the model is ~31 MB) changes the
  output; pushing the original weights back restores the original output exactly; pushing the perturbed ones
  again (other bucket bound) reproduces the first update exactly; the same for both ways of loading (the direct
  load that ``auto`` takes for this dense bf16 model, and vLLM's layerwise reload), and the two agree bitwise;
* sleep level 1 (weights kept on the host) then wake: output unchanged; level 2 (weights discarded), wake
  the weights only, push, wake the KV cache: output equals the pushed weights' output; each sleep frees at
  least 90% of the KV cache's bytes on the device;
* waking up hands back what PyTorch's caching allocator holds (the trainer's freed memory), so the KV cache
  fits where it otherwise would not.

Skipped without CUDA or without vLLM (CI); run on the H200 by ``bench/run_device.sh vllm``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.rollout_engine_checks import (PROMPTS, check_greedy_generation, check_updates_are_exact, device_used,
                                           greedy, original_and_perturbed, push, write_model)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KV_CACHE_BYTES = 4 << 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen2_gpu"))


@pytest.fixture(scope="module")
def engine(model_dir):
    pytest.importorskip("vllm")
    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine

    # eager: a quicker start; CUDA graphs run in the trainer benchmarks (bench/e2e_grpo.py)
    # no prefix caching: every compared generation then prefills from scratch (a cache hit skips part of the
    # prefill and changes the bf16 sums, so a cached and an uncached run may differ in a near-tied argmax)
    engine = VLLMRolloutEngine(str(model_dir), dtype="bfloat16", in_process=True, enable_sleep_mode=True,
                               enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0,
                               gpu_memory_utilization=0.2, enable_prefix_caching=False)
    assert engine.in_process
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def weights(model_dir):
    return original_and_perturbed(model_dir)


def test_generation(engine):
    check_greedy_generation(engine)


@pytest.fixture
def reload_mode(engine, request):
    engine.weight_reload = request.param
    yield request.param
    engine.weight_reload = "auto"


OUTPUTS_BY_MODE: dict = {}


@pytest.mark.parametrize("reload_mode", ["auto", "layerwise"], indirect=True)
def test_device_tensor_updates_are_exact(engine, weights, reload_mode):
    original, perturbed = weights
    after = check_updates_are_exact(engine, original, perturbed)  # ends on the original weights
    assert engine.weight_reload_taken == ("direct" if reload_mode == "auto" else "layerwise")
    OUTPUTS_BY_MODE[reload_mode] = after
    if len(OUTPUTS_BY_MODE) == 2:
        assert OUTPUTS_BY_MODE["auto"] == OUTPUTS_BY_MODE["layerwise"]


def test_sleep_releases_memory_and_keeps_or_takes_weights(engine, weights):
    original, perturbed = weights
    push(engine, original, bucket_bytes=8 << 20)
    reference = greedy(engine)

    awake = device_used()
    engine.sleep()  # level 1: weights to host memory
    freed = awake - device_used()
    assert freed >= 0.9 * KV_CACHE_BYTES, freed
    engine.wake_up()
    assert greedy(engine) == reference

    engine.sleep(discard_weights=True)  # level 2: the hybrid engine's sleep (a weight sync follows)
    assert awake - device_used() >= 0.9 * KV_CACHE_BYTES
    with pytest.raises(RuntimeError, match="asleep"):
        greedy(engine)
    engine.wake_up(weights_only=True)
    push(engine, perturbed, bucket_bytes=8 << 20)
    engine.wake_up()
    pushed = greedy(engine)
    push(engine, perturbed, bucket_bytes=20 << 20)
    assert greedy(engine) == pushed != reference


def test_wake_up_takes_back_what_the_trainer_left_in_pytorchs_cache(engine, weights):
    """The trainer's freed activations stay reserved in PyTorch's caching allocator; vLLM's sleep-mode pool
    cannot use them. Fill the device so that the KV cache fits only if that cache is handed back, then wake."""
    original, _ = weights
    push(engine, original, bucket_bytes=8 << 20)
    engine.sleep(discard_weights=True)
    free, _ = torch.cuda.mem_get_info()
    margin = KV_CACHE_BYTES // 2  # less than the KV cache needs
    block = torch.empty(free - margin, dtype=torch.uint8, device="cuda")
    del block  # freed, but still reserved by PyTorch
    assert torch.cuda.mem_get_info()[0] < KV_CACHE_BYTES  # the KV cache cannot be mapped as things stand
    engine.wake_up(weights_only=True)
    push(engine, original, bucket_bytes=8 << 20)
    engine.wake_up()  # ran out of memory here before wake_up emptied PyTorch's cache
    assert len(greedy(engine)) == len(PROMPTS)
