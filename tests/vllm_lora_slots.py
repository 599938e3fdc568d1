"""Reading a vLLM worker's LoRA slots in tests (CPU and GPU): called through ``LLM.collective_rpc``, which hands
these functions vLLM's worker wrapper (it forwards attribute reads to the worker, not writes)."""

from __future__ import annotations


def slots_and_path(worker):
    """Every LoRA layer's slots in the engine (copies), and which way megarl's last adapter load went."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slots = {}
    for name, module in manager.modules.items():
        for i, (a, b) in enumerate(zip(module.lora_a_stacked, module.lora_b_stacked)):
            slots[f"{name}[{i}].A"], slots[f"{name}[{i}].B"] = a.clone(), b.clone()
    return worker._megarl_served_adapter.last_path, slots


def scribble_on_the_slots(worker):
    """What a sleep that dropped the engine's memory would leave: no slot keeps its values."""
    for module in worker.model_runner.lora_manager._adapter_manager.modules.values():
        for stacked in (*module.lora_a_stacked, *module.lora_b_stacked):
            stacked.fill_(1.0)


def forget_the_served_adapter(wrapper):
    wrapper.worker._megarl_served_adapter = None  # its next load goes vLLM's own way


def slots_differing(first: dict, second: dict) -> list[str]:
    import torch

    return [name for name in first if not torch.equal(first[name], second[name])]
