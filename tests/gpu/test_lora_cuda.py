"""LoRA on CUDA: the Megatron actor's adapters (bf16 model, fp32 comparisons as on CPU) and vLLM serving an adapter
handed over as device tensors.

* Megatron: a zero-B adapter is the base model exactly, only the adapters train, the adapters switched off are
  the base exactly, the merged weights give the adapted log-probs, an adapters-only checkpoint resumes exactly,
  full recompute trains them as stored activations do (the CPU test's worlds, run on the GPU);
* vLLM (bf16, in process, in a spawned process of its own): a zero-B adapter gives the base model's tokens and log-probs bitwise; an
  adapter moves them; loading a second adapter and then the first again gives the first's first-token log-probs
  back (the in-memory load replaces the adapter, nothing stale stays); the adapter load time is printed (the issue's
  <= 50 ms goal is measured at 7B-32B by bench/run_device.sh lora); base weights synced into the engine that serves
  LoRA load (direct, through the LoRA wrappers' names) and another model's weights are replaced exactly.
Skipped without CUDA (CI); vLLM's part also without vLLM.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(300)
def test_megatron_lora_on_cuda(tmp_path):
    from tests.dist_harness import run_distributed
    from tests.distributed.engines.megatron import test_lora

    result = run_distributed(test_lora._world_tp1, 1, str(tmp_path), cuda=True)[0]
    test_lora.test_lora_trains_the_adapters_only_and_switches_off_to_the_base(result)
    test_lora.test_adapter_checkpoint_is_small_and_resumes_exactly(result)
    # full recompute trains the adapters as stored activations do (until 2026-12-07 it cut them off: grad norm 0);
    # fp32 on both sides, the kernels' reduction order may differ between the recomputed and the stored forward
    recomputed = run_distributed(test_lora._world_recomputed, 1, cuda=True)[0]
    for got, want in zip(recomputed["history"], result["history"], strict=True):
        assert got["grad_norm"] > 0 and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-4, abs=1e-6)


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_vllm_serves_adapters_from_device_tensors(tmp_path):
    pytest.importorskip("vllm")
    from tests.dist_harness import run_distributed

    # a process of its own: vLLM keeps process-wide state (one sleep-mode allocator, the torch.distributed world
    # an in-process engine creates) that would change how the other GPU tests' engines start
    result = run_distributed(_vllm_lora_world, 1, str(tmp_path), cuda=True)[0]
    print(f"adapter load: {result['adapter_mib']:.1f} MiB in {result['load_ms']:.1f} ms into vLLM's slots, "
          f"{result['vllm_load_ms']:.1f} ms vLLM's own way")
    assert (result["in_place_path"], result["vllm_path"]) == ("in_place", "vllm")
    assert not result["slots_differing"], result["slots_differing"]
    base, zero_b, with_first, with_third, again = (result[k] for k in ("base", "zero_b", "first", "third", "again"))
    assert zero_b == base  # B = 0: the base model, bitwise
    assert with_first[0] != base[0]
    # vLLM's LoRA kernels reduce in no fixed order (split-K), so later tokens of a greedy run may part at a near
    # tie: compare the first generated token's log-prob of every prompt, at bf16's resolution
    first_lp = torch.tensor([lp[0] for lp in with_first[1]])
    assert (torch.tensor([lp[0] for lp in again[1]]) - first_lp).abs().max() < 0.05  # the first is back
    assert (torch.tensor([lp[0] for lp in with_third[1]]) - first_lp).abs().max() > 0.1  # the third replaced it
    # base weights synced into the engine that serves LoRA (lora.merge=false sends the base once; on CUDA a direct
    # load, whose vLLM 0.26 loaders need the LoRA wrappers' names): another model's weights change the tokens, the
    # first model's bring them back bitwise (a direct load copies)
    assert result["reload"] == "direct"
    assert result["other_base"] != base
    assert result["base_again"] == base


def _vllm_lora_world(rank, model_dir):
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine
    from tests.gpu.rollout_engine_checks import CONFIG, PROMPTS
    from tests.vllm_lora_slots import forget_the_served_adapter, scribble_on_the_slots, slots_and_path, slots_differing

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    engine = VLLMRolloutEngine(str(model_dir), dtype="bfloat16", in_process=True, enforce_eager=True,
                               max_model_len=512, kv_cache_memory_bytes=2 << 30, seed=0, gpu_memory_utilization=0.2,
                               enable_prefix_caching=False, lora_rank=16)
    try:
        greedy = SamplingConfig.greedy(max_tokens=16, logprobs=True, ignore_eos=True)
        shapes = {"self_attn.q_proj": (512, 512), "self_attn.k_proj": (128, 512), "self_attn.v_proj": (128, 512),
                  "self_attn.o_proj": (512, 512), "mlp.gate_proj": (1408, 512), "mlp.up_proj": (1408, 512),
                  "mlp.down_proj": (512, 1408)}
        config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": [k.split(".")[1] for k in shapes]}

        def adapter(seed, zero_b=False):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            named = []
            for layer in range(CONFIG["num_hidden_layers"]):
                for module, (out_f, in_f) in shapes.items():
                    prefix = f"base_model.model.model.layers.{layer}.{module}"
                    a = torch.randn(16, in_f, generator=gen, device="cuda") * 0.05
                    b = torch.randn(out_f, 16, generator=gen, device="cuda") * 0.05
                    named += [(f"{prefix}.lora_A.weight", a.bfloat16()),
                              (f"{prefix}.lora_B.weight", (b * 0 if zero_b else b).bfloat16())]
            return named

        def run():
            outputs = engine.generate(PROMPTS, greedy)
            return [o.token_ids for o in outputs], [o.log_probs for o in outputs]

        out = {"base": run()}
        other_dir = Path(model_dir) / "other"
        torch.manual_seed(1)
        Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(other_dir, safe_serialization=True)
        for key, weights_dir in (("other_base", other_dir), ("base_again", Path(model_dir))):
            engine.update_weights([(n, t.cuda()) for n, t in load_file(weights_dir / "model.safetensors").items()])
            engine.finish_weight_update()
            out[key] = run()
        out["reload"] = engine.weight_reload_taken
        engine.load_adapter(adapter(1, zero_b=True), config)
        out["zero_b"] = run()
        first = adapter(2)

        def timed_load(named):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.load_adapter(named, config)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3

        # the second load of this shape writes into vLLM's slots directly (ServedAdapter); what it leaves there
        # is bit for bit what vLLM's own load of the same adapter leaves, even over slots a sleep had dropped
        engine.llm.collective_rpc(scribble_on_the_slots)
        out["load_ms"] = timed_load(first)
        out["in_place_path"], in_place = engine.llm.collective_rpc(slots_and_path)[0]
        engine.llm.collective_rpc(forget_the_served_adapter)
        out["vllm_load_ms"] = timed_load(first)
        out["vllm_path"], vllms_own = engine.llm.collective_rpc(slots_and_path)[0]
        out["slots_differing"] = slots_differing(in_place, vllms_own)
        out["adapter_mib"] = sum(t.numel() * 2 for _, t in first) / 2**20
        out["first"] = run()
        engine.load_adapter(adapter(3), config)
        out["third"] = run()
        engine.load_adapter(first, config)
        out["again"] = run()
        return out
    finally:
        engine.shutdown()
