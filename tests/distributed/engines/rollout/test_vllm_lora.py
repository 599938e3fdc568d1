"""LoRA served by the rollout engines from adapter tensors in memory: vLLM (CPU build, its punica LoRA kernels)
against the HF engine, which serves an adapter by merging it (``W + alpha/r * B @ A`` in fp32). The same
adapter gives the same greedy tokens and log-probs on both; a second adapter replaces the first; an adapter
with B = 0 gives the base model. One vLLM engine for the module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megarl.engines.rollout.base import SamplingConfig  # noqa: E402
from megarl.engines.rollout.factory import build_rollout_engine  # noqa: E402
from megarl.engines.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from tests.vllm_lora_slots import (forget_the_served_adapter, scribble_on_the_slots, slots_and_path,  # noqa: E402
                                   slots_differing)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
RANK, ALPHA = 8, 16.0
PROJECTIONS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
               "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
               "mlp.down_proj": (128, 256)}
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": [p.split(".")[1] for p in PROJECTIONS],
          "lora_dropout": 0.0, "bias": "none"}


def random_adapter(seed: int, *, zero_b: bool = False) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(2):
        for module, (out_features, in_features) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            named.append((f"{prefix}.lora_A.weight", torch.randn(RANK, in_features, generator=gen) * 0.1))
            b = torch.randn(out_features, RANK, generator=gen) * 0.1
            named.append((f"{prefix}.lora_B.weight", torch.zeros_like(b) if zero_b else b))
    return named


@pytest.fixture(scope="module")
def vllm_engine(tiny_qwen2_dir):
    engine = build_rollout_engine(
        "vllm", str(tiny_qwen2_dir), dtype="float32", enforce_eager=True, max_model_len=128,
        gpu_memory_utilization=0.3, kv_cache_memory_bytes=64 << 20, block_size=32, seed=0, lora_rank=RANK,
        in_process=True)
    yield engine
    engine.shutdown()


GREEDY = SamplingConfig.greedy(max_tokens=8, logprobs=True, ignore_eos=True)


def _log_probs(outputs) -> torch.Tensor:
    return torch.tensor([o.log_probs for o in outputs])


def test_served_adapter_matches_the_merged_weights(vllm_engine, tiny_qwen2_dir):
    hf = HFRolloutEngine(str(tiny_qwen2_dir))
    base = hf.generate(PROMPTS, GREEDY)
    for seed in (1, 2):  # the second adapter replaces the first in both engines
        adapter = random_adapter(seed)
        vllm_engine.load_adapter(adapter, CONFIG)
        hf.load_adapter(adapter, CONFIG)
        served, merged = vllm_engine.generate(PROMPTS, GREEDY), hf.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in served] == [o.token_ids for o in merged]
        torch.testing.assert_close(_log_probs(served), _log_probs(merged), atol=1e-3, rtol=0)
        # the adapter acted: the tokens' log-probs moved away from the base model's by far more than the tolerance
        assert (_log_probs(merged) - _log_probs(base)).abs().max() > 0.05


def test_zero_b_adapter_is_the_base_model(vllm_engine, tiny_qwen2_dir):
    base = HFRolloutEngine(str(tiny_qwen2_dir)).generate(PROMPTS, GREEDY)
    vllm_engine.load_adapter(random_adapter(3, zero_b=True), CONFIG)
    served = vllm_engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in served] == [o.token_ids for o in base]
    torch.testing.assert_close(_log_probs(served), _log_probs(base), atol=1e-3, rtol=0)


def test_adapter_rank_above_the_engines_is_refused(vllm_engine):
    with pytest.raises(ValueError, match="rank 16 > lora_rank 8"):
        vllm_engine.load_adapter(random_adapter(4), {**CONFIG, "r": 16})


def test_the_exported_peft_directory_is_what_vllm_loads_from_disk(vllm_engine, tmp_path):
    """megarl's PEFT export (save_peft_adapter) read by vLLM's own loader, by path, gives what the in-memory
    hand-over gives."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from megarl.weight_sync.adapters import save_peft_adapter

    adapter = random_adapter(5)
    save_peft_adapter(adapter, dict(CONFIG), tmp_path / "adapter")
    vllm_engine.load_adapter(adapter, CONFIG)
    served = vllm_engine.generate(PROMPTS, GREEDY)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    from_disk = vllm_engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False,
                                         lora_request=LoRARequest("from-disk", 7, str(tmp_path / "adapter")))
    assert [list(r.outputs[0].token_ids) for r in from_disk] == [o.token_ids for o in served]


def test_base_weights_reach_the_wrapped_linears_by_name(vllm_engine, tiny_qwen2_dir):
    """A base sync into an engine that serves LoRA (lora.merge=false, the base sent once): vLLM wrapped its LoRA
    targets after loading the checkpoint, so their weights are ``<module>.base_layer.weight``. vLLM 0.26's
    loaders look names up that way and refused ``o_proj.weight`` at 14B on the H100 (2026-12-07). Every
    checkpoint name, renamed by ``names_through_lora_wrappers`` and then by vLLM's own HF-to-vLLM mapping, must
    name a parameter of the wrapped model. This CPU build's wrappers take the plain names themselves
    (``lora_base_layer_names`` leaves them), which the served e2e test loads."""
    from safetensors import safe_open

    names = []
    for path in sorted(tiny_qwen2_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())

    def resolve(worker):
        from megarl.engines.rollout.vllm_compat import names_through_lora_wrappers

        model = worker.model_runner.get_model()
        rename = names_through_lora_wrappers(model)
        params = dict(model.named_parameters())
        return {name: (rename(name), model.hf_to_vllm_mapper._map_name(rename(name)) in params) for name in names}

    resolved = vllm_engine.llm.collective_rpc(resolve)[0]
    unresolved = {name: new for name, (new, found) in resolved.items() if not found}
    assert not unresolved, f"checkpoint names that reach no parameter of the LoRA-wrapped model: {unresolved}"
    renamed = {name for name, (new, _) in resolved.items() if new != name}
    # exactly the seven projections of each layer (and q/k/v's biases): the norms and embeddings keep their names
    assert renamed == {f"model.layers.{layer}.{module}.weight" for layer in range(2) for module in PROJECTIONS} | {
        f"model.layers.{layer}.self_attn.{p}_proj.bias" for layer in range(2) for p in "qkv"}


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"]], ids=["all_linears", "q_and_v"])
def test_later_loads_write_the_adapter_into_vllms_slots_as_vllms_own_load_does(vllm_engine, targets):
    """After an adapter's first load (vLLM's own way), loads of an adapter with the same names, shapes and config
    write each tensor into the slot vLLM put it in (``ServedAdapter``, 56-74 ms vLLM's way at 14B on an H100).
    What that leaves in every LoRA slot of the engine is bit for bit what vLLM's own load of the same adapter
    leaves (alpha / r folded into B; with q and v only, the k slices of the fused qkv and the untargeted layers
    zero, whatever the slots held before), and it generates the same; another config goes vLLM's way again."""
    config = dict(CONFIG) if targets is None else {**CONFIG, "target_modules": targets}

    def adapter(seed):
        return [(name, t) for name, t in random_adapter(seed)
                if targets is None or any(f".{target}." in name for target in targets)]

    rpc = vllm_engine.llm.collective_rpc
    rpc(forget_the_served_adapter)
    vllm_engine.load_adapter(adapter(6), config)
    assert rpc(slots_and_path)[0][0] == "vllm"
    rpc(scribble_on_the_slots)  # every slot the adapter's load leaves must be written, not only the targets'
    vllm_engine.load_adapter(adapter(7), config)
    path, in_place = rpc(slots_and_path)[0]
    assert path == "in_place"
    in_place_tokens = vllm_engine.generate(PROMPTS, GREEDY)
    rpc(forget_the_served_adapter)
    vllm_engine.load_adapter(adapter(7), config)
    path, vllms_own = rpc(slots_and_path)[0]
    assert path == "vllm"
    differing = slots_differing(in_place, vllms_own)
    assert not differing, f"slots the in-place load left otherwise than vLLM's own: {differing}"
    assert any(slot.abs().sum() > 0 for slot in vllms_own.values())
    assert [o.log_probs for o in vllm_engine.generate(PROMPTS, GREEDY)] == [o.log_probs for o in in_place_tokens]
    vllm_engine.load_adapter(adapter(8), {**config, "lora_alpha": 2 * ALPHA})
    assert rpc(slots_and_path)[0][0] == "vllm"
