"""LoRA adapters from TP/PP/EP-sharded Megatron models into the HF rollout engine, both ways, on real gloo worlds:
merged into the ordinary weight sync, and served (the base once with the adapters off, then the adapter alone in
PEFT names). Either way the rollout engine's logits equal the trainer's (its LoRA forward). The PEFT adapter
written by ``save_peft_adapter`` and read back by ``load_peft_adapter`` into zeroed adapters gives the trainer's
logits bitwise, and peft's own ``PeftModel`` on the HF model gives the trainer's logits from that directory."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.distributed.models.bridge_workers import TWO_RANK_LAYOUTS, build_chunks, forward_logits, sample_tokens

BUCKET_BYTES = 64 * 1024


def _fill_adapters(chunks, *, zero: bool = False) -> None:
    """Non-zero A and B (or zeros), seeded by name: a replicated factor is the same on every TP rank, a split
    one differs per rank (it is a shard)."""
    from megatron.core import parallel_state as mpu

    from megarl.models.lora import iter_adapters

    with torch.no_grad():
        for _, name, module in iter_adapters(chunks):
            adapter = module.adapter
            for factor, param in (("A", adapter.lora_A), ("B", adapter.lora_B)):
                split = getattr(param, "tensor_model_parallel", False)
                seed = zlib.crc32(f"{name}.{factor}".encode()) + (mpu.get_tensor_model_parallel_rank() if split else 0)
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
                param.copy_(torch.zeros_like(param) if zero else 0.2 * noise)


def _world(rank, hf_dir, layout_kwargs, out_dir):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.engines.rollout.hf_engine import HFRolloutEngine
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.models.lora import LoRASpec, adapters_disabled, attach_lora
    from megarl.weight_sync import ColocatedTransport, sync_weights
    from megarl.weight_sync.adapters import gather_peft_adapter, load_peft_adapter, peft_adapter_config, save_peft_adapter

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=5)
    bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
    spec = LoRASpec(rank=4, alpha=8.0, init_seed=1)
    num_experts = bridge.dims.num_experts
    local_experts = num_experts // layout.expert_parallel if num_experts else None

    def lora_chunks():
        chunks = build_chunks(bridge, bridge.transformer_config(layout=layout))
        for chunk in chunks:
            attach_lora(chunk, spec)
        load_hf_weights(chunks, hf_dir, bridge)
        return chunks

    chunks = lora_chunks()
    _fill_adapters(chunks)
    tokens = sample_tokens(bridge.dims.vocab_size)
    trainer_logits = forward_logits(chunks, tokens, bridge.dims.vocab_size)

    merged_engine = HFRolloutEngine(hf_dir)
    sync_weights(chunks, bridge, ColocatedTransport(merged_engine), bucket_bytes=BUCKET_BYTES,
                 num_local_experts=local_experts)
    served_engine = HFRolloutEngine(hf_dir)
    with adapters_disabled(chunks):
        sync_weights(chunks, bridge, ColocatedTransport(served_engine), bucket_bytes=BUCKET_BYTES,
                     num_local_experts=local_experts)
    named = gather_peft_adapter(chunks, bridge, num_local_experts=local_experts)
    config = peft_adapter_config(spec, named)
    served_engine.load_adapter(named, config)
    if rank == 0:
        save_peft_adapter(named, config, out_dir)
    torch.distributed.barrier()

    reloaded = lora_chunks()
    _fill_adapters(reloaded, zero=True)
    load_peft_adapter(reloaded, bridge, out_dir, spec, num_local_experts=local_experts)
    reloaded_logits = forward_logits(reloaded, tokens, bridge.dims.vocab_size)
    with torch.no_grad():
        merged_logits = merged_engine.model(input_ids=tokens).logits
        served_logits = served_engine.model(input_ids=tokens).logits
    return dict(trainer=trainer_logits, merged=merged_logits, served=served_logits, reloaded=reloaded_logits,
                names=sorted(n for n, _ in named))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch, layout", TWO_RANK_LAYOUTS)
def test_merged_and_served_adapters_give_the_trainers_logits(tmp_path, arch, layout):
    from megarl.models.tiny import save_tiny_hf_checkpoint
    from tests.distributed.models.bridge_workers import hf_logits

    hf_dir = str(save_tiny_hf_checkpoint(arch, tmp_path / arch, seed=0))
    results = run_distributed(_world, 2, hf_dir, layout, str(tmp_path / "adapter"))
    trainer = [r["trainer"] for r in results if r["trainer"] is not None]
    assert trainer
    base = hf_logits(hf_dir, sample_tokens(results[0]["merged"].shape[-1]))
    for r in results:
        for got in ("merged", "served"):
            torch.testing.assert_close(r[got], trainer[0], rtol=1e-4, atol=1e-4, msg=got)
        if r["reloaded"] is not None:
            torch.testing.assert_close(r["reloaded"], trainer[0], rtol=0, atol=0)
    assert (results[0]["merged"] - base).abs().max() > 1e-2  # the adapters changed the model
    assert results[0]["names"] == results[1]["names"]  # every rank gathered the whole adapter
    assert any(".q_proj.lora_A" in n for n in results[0]["names"])
    # the directory is a PEFT adapter: peft itself applies it to the HF model and gets the trainer's logits
    peft = pytest.importorskip("peft")
    import transformers

    base_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                   attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        peft_logits = model(input_ids=sample_tokens(results[0]["merged"].shape[-1])).logits
    torch.testing.assert_close(peft_logits, trainer[0], rtol=1e-4, atol=1e-4)
