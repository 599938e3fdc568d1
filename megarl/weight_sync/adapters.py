"""LoRA adapters out of the Megatron shards as a PEFT adapter, and a PEFT adapter back into them.

PEFT (and vLLM's LoRA serving) name an adapter per HF projection: ``base_model.model.<hf module>.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, scaled by ``lora_alpha / r``. Megatron's adapters sit on the
fused linears (:mod:`megarl.models.lora`), so one fused adapter becomes several PEFT ones: a column linear's
``B`` has the rows of its weight, and the bridge splits it exactly as it splits the weight (q/k/v out of
megatron's interleaved ``linear_qkv``, gate/up out of ``linear_fc1``), each piece with the shared ``A``; a row
linear's ``A`` has its weight's columns. Going back, the q/k/v (gate/up) pieces of one fused adapter must share
their ``A``, which PEFT adapters trained elsewhere need not do: those are refused, naming the module.

:func:`gather_peft_adapter` is collective over a model-parallel replica (TP/EP all-gathers, then the pipeline
stages' pieces broadcast) and returns every tensor on every rank; adapters are small (tens of MB at 32B), so
they travel whole. Leaves out: expert adapters under expert tensor parallelism (refused when attached).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.lora import LoRASpec, iter_adapters
from megarl.weight_sync.gather import _all_gather, _Groups, _layer_offset, local_experts

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
NamedTensors = list[tuple[str, torch.Tensor]]


def _peft_names(hf_weight_name: str) -> tuple[str, str]:
    module = hf_weight_name.removesuffix(".weight")
    return f"{_PEFT_PREFIX}{module}.lora_A.weight", f"{_PEFT_PREFIX}{module}.lora_B.weight"


def _global_weight_names(bridge, chunk_index: int, module_name: str, model_chunks, g: _Groups,
                         num_local_experts: int, expert: bool) -> list[str]:
    offset = _layer_offset(model_chunks[chunk_index], chunk_index if g.vpp else None)
    ep_ranks = range(g.ep_size) if expert else range(g.ep_rank, g.ep_rank + 1)
    return [bridge.local_to_global_name(f"{module_name}.weight", layer_offset=offset, ep_rank=ep,
                                        num_local_experts=num_local_experts) for ep in ep_ranks]


def _stage_adapter(bridge, model_chunks, g: _Groups, num_local_experts: int) -> NamedTensors:
    """This pipeline stage's adapters as PEFT tensors (collectives within the stage)."""
    out: NamedTensors = []
    for chunk_index, module_name, module in iter_adapters(model_chunks):
        adapter = module.adapter
        split, replicated = ((adapter.lora_B, adapter.lora_A) if adapter.kind == "column"
                             else (adapter.lora_A, adapter.lora_B))
        if adapter.is_expert:  # each EP rank holds its own experts (expert TP is 1, see megarl.models.lora)
            names = _global_weight_names(bridge, chunk_index, module_name, model_chunks, g, num_local_experts, True)
            splits = _all_gather(split, g.ep_group, g.ep_size)
            replicas = _all_gather(replicated, g.ep_group, g.ep_size)
        else:
            names = _global_weight_names(bridge, chunk_index, module_name, model_chunks, g, num_local_experts, False)
            pieces = _all_gather(split, g.tp_group, g.tp_size)
            splits = [bridge.merge_tp(names[0], pieces) if g.tp_size > 1 else split.detach()]
            replicas = [replicated.detach()]
        for global_name, full_split, other in zip(names, splits, replicas):
            hf_pieces = bridge.mcore_to_hf(global_name, full_split)
            if adapter.kind == "column":  # B carries the rows the bridge splits; every piece shares A
                for hf_name, lora_b in hf_pieces:
                    name_a, name_b = _peft_names(hf_name)
                    out += [(name_a, other), (name_b, lora_b)]
            else:
                (hf_name, lora_a), = hf_pieces
                name_a, name_b = _peft_names(hf_name)
                out += [(name_a, lora_a), (name_b, other)]
    return out


def gather_peft_adapter(model_chunks, bridge, *, num_local_experts: Optional[int] = None,
                        dtype: Optional[torch.dtype] = None) -> NamedTensors:
    """Every adapter tensor of the replica in PEFT names, on every rank of it (collective)."""
    g = _Groups()
    num_local_experts = local_experts(bridge, g, num_local_experts)
    with torch.no_grad():
        named = _stage_adapter(bridge, model_chunks, g, num_local_experts)
        if g.pp_size > 1:  # small: every stage's tensors to every stage as host objects
            stages = [None] * g.pp_size
            dist.all_gather_object(stages, [(n, t.cpu()) for n, t in named], group=g.pp_group)
            device = named[0][1].device if named else torch.device("cpu")
            named = [(n, t.to(device)) for stage in stages for n, t in stage]
    return [(n, t.to(dtype) if dtype is not None else t.detach()) for n, t in named]


def peft_adapter_config(spec: LoRASpec, named: NamedTensors, *, base_model: Optional[str] = None) -> dict:
    """``adapter_config.json`` for these tensors: PEFT's keys, the HF projections they adapt."""
    modules = sorted({name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1]
                      for name, _ in named if name.endswith(".lora_A.weight")})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}


def save_peft_adapter(named: NamedTensors, config: dict, out_dir: str | os.PathLike) -> Path:
    """Write a PEFT adapter directory (weights first, the config last: a directory without it is not an adapter)."""
    from safetensors.torch import save_file

    from megarl.checkpoint_io.files import publish, temporary_name, write_json_atomically

    out = Path(out_dir)
    if (out / ADAPTER_CONFIG).exists():
        raise FileExistsError(f"{out / ADAPTER_CONFIG} exists: {out} already holds an adapter")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named}
    partial = temporary_name(out / ADAPTER_WEIGHTS)
    save_file(tensors, partial, metadata={"format": "pt"})
    publish(partial, out / ADAPTER_WEIGHTS)
    write_json_atomically(out / ADAPTER_CONFIG, config)
    return out


def read_peft_adapter(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"LoRA adapter_path {path}: no {name} (a PEFT adapter directory has "
                                    f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    tensors = {(k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k): v
               for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    return config, tensors


def load_peft_adapter(model_chunks, bridge, adapter_dir: str | os.PathLike, spec: LoRASpec, *,
                      num_local_experts: Optional[int] = None) -> int:
    """Set this rank's adapter shards from a PEFT adapter directory; returns the adapters filled. The adapter's
    rank and alpha must be the run's, and it must cover every module the run adapts (others in it are not read)."""
    from megatron.core import parallel_state as mpu

    config, tensors = read_peft_adapter(adapter_dir)
    if int(config.get("r", -1)) != spec.rank or float(config.get("lora_alpha", -1)) != float(spec.alpha):
        raise ValueError(f"LoRA adapter_path {adapter_dir}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; "
                         f"the run's lora is rank={spec.rank}, alpha={spec.alpha}")
    g = _Groups()
    num_local_experts = local_experts(bridge, g, num_local_experts)
    filled = 0

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"LoRA adapter_path {adapter_dir} has no {name} (the run adapts that module)")
        return tensors[name]

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for chunk_index, module_name, module in iter_adapters(model_chunks):
            adapter = module.adapter
            (global_name,) = _global_weight_names(bridge, chunk_index, module_name, model_chunks, g,
                                                  num_local_experts, False)
            hf_names = bridge.hf_names_for(global_name)
            if adapter.kind == "column":
                a_pieces = [take(_peft_names(n)[0]) for n in hf_names]
                if any(not torch.equal(a_pieces[0], a) for a in a_pieces[1:]):
                    raise ValueError(f"LoRA adapter_path {adapter_dir}: {', '.join(hf_names)} have different lora_A; "
                                     f"megarl's {global_name} adapter is one fused adapter with one A")
                full_b = bridge.hf_to_mcore(global_name, {n: take(_peft_names(n)[1]) for n in hf_names})
                lora_a = a_pieces[0]
                lora_b = full_b if adapter.is_expert else bridge.shard_tp(global_name, full_b, tp_rank, tp_size)
            else:
                (hf_name,) = hf_names
                full_a = take(_peft_names(hf_name)[0])
                lora_a = full_a if adapter.is_expert else bridge.shard_tp(global_name, full_a, tp_rank, tp_size)
                lora_b = take(_peft_names(hf_name)[1])
            for param, value, what in ((adapter.lora_A, lora_a, "lora_A"), (adapter.lora_B, lora_b, "lora_B")):
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"LoRA adapter_path {adapter_dir}: {global_name} {what} shard is "
                                     f"{tuple(value.shape)}, the model's is {tuple(param.shape)}")
                param.copy_(value.to(dtype=param.dtype))
            filled += 1
    return filled
