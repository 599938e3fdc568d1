"""LoRA adapters on megatron's parallel linears: a frozen base and a trainable low-rank update.

    y = W x + (alpha / rank) * B A dropout(x)

An adapter is a child module ``adapter`` of the linear it adapts plus a forward hook that adds its output;
the base's parameter names do not change, so the bridge, HF loading and the weight sync see the model they
know, and :func:`adapters_disabled` gives back the base model (the reference policy) without a second copy.
verl's Megatron names: ``linear_qkv`` (fused q/k/v) and ``linear_fc1`` (fused gate/up) are column-parallel,
``linear_proj`` and ``linear_fc2`` row-parallel.

Tensor parallelism, in megatron's convention (column splits W's rows, row splits W's columns):

* column: ``A [r, in]`` replicated, ``B [out/tp, r]`` split like W's rows. Each rank's ``B`` reads all of
  ``A x``, so the gradient of ``A x`` is summed over TP in backward (``copy_to_tensor_model_parallel_region``);
* row: ``A [r, in/tp]`` split like W's columns, ``B [out, r]`` replicated; ``A x`` is a partial sum, all-reduced
  in forward (``reduce_from_tensor_model_parallel_region``).

Either way ``W_shard + s * B_shard @ A_shard`` is exactly this rank's shard of the merged weight
(:func:`merged_weight`), so merging needs no communication. ``A`` starts as a seeded function of the adapted
module's global name and its full shape, sliced per rank, so any TP layout starts from the same adapter;
``B`` starts at zero, so the adapted model starts as the base model exactly.

Experts (``SequentialMLP``'s linears) are adapted like any linear when their tensor-parallel group is one
rank (expert TP 1; any expert parallelism): the token dispatcher does their communication.
Leaves out: Transformer Engine's fused LayerNorm-linears (their input is the un-normalised stream) and grouped
experts (no per-expert linear); sequence parallelism (megatron's local norms refuse it, and LoRA needs the
local linears); expert tensor parallelism > 1; DoRA and canonical (unfused q/k/v) LoRA.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megarl.config.lora import TARGETS

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ADAPTER_ATTR = "adapter"
_ADAPTER_NAME = re.compile(rf"(^|\.){ADAPTER_ATTR}\.lora_[AB]$")


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (as ``named_parameters`` gives it) is an adapter's ``lora_A``/``lora_B``."""
    return bool(_ADAPTER_NAME.search(name))


@dataclass(frozen=True)
class LoRASpec:
    """What to adapt and how: ``rank`` > 0, ``alpha`` (the update is scaled by alpha / rank), ``dropout`` on
    the adapter's input, megatron linear names in ``targets``, glob patterns in ``exclude`` matched against
    the module's name (with global layer numbers, e.g. ``decoder.layers.0.*``) or its last component."""

    rank: int
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    exclude: tuple[str, ...] = field(default_factory=tuple)
    init_seed: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = set(self.targets) - set(TARGETS)
        if unknown:
            raise ValueError(f"LoRA targets {sorted(unknown)} are not megatron linears {TARGETS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one parallel linear; see the module docstring for the layouts."""

    def __init__(self, *, kind: str, in_features: int, out_features: int, spec: LoRASpec, tp_group,
                 is_expert: bool, dtype: torch.dtype, device, seed_name: str, allreduce: bool = True):
        super().__init__()
        from megatron.core.utils import get_pg_rank, get_pg_size

        if kind not in ("column", "row"):
            raise ValueError(f"LoRAAdapter kind must be column or row, got {kind!r}")
        self.kind, self.scale, self.dropout = kind, spec.scale, spec.dropout
        self.tp_group, self.is_expert = tp_group, is_expert
        self.tp_size, tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
        self.enabled = True
        if is_expert and self.tp_size > 1:
            raise ValueError("LoRA on experts needs expert_tensor_parallel_size=1 (the token dispatcher's "
                             "expert tensor parallelism is not adapted)")
        # A's full [rank, in_features] from a generator seeded by the module's global name: every layout
        # starts from the same adapter (the row kind keeps its columns of it)
        generator = torch.Generator().manual_seed(spec.init_seed + zlib.crc32(seed_name.encode()))
        full_in = in_features * (self.tp_size if kind == "row" else 1)
        lora_a = torch.empty(spec.rank, full_in)
        torch.nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)  # nn.Linear's (and PEFT's)
        if kind == "row":
            lora_a = lora_a.chunk(self.tp_size, dim=1)[tp_rank]
        self.lora_A = torch.nn.Parameter(lora_a.to(dtype=dtype, device=device).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, spec.rank, dtype=dtype, device=device))
        split = self.lora_B if kind == "column" else self.lora_A
        if self.tp_size > 1:  # megatron's grad-norm counts a split tensor on every rank, a replicated one once
            split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, (
                0 if kind == "column" else 1), 1
        for param in (self.lora_A, self.lora_B):
            param.allreduce = allreduce  # expert adapters reduce over the expert-data-parallel group, like W

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)`` laid out like the base linear's output on this rank."""
        from megatron.core.tensor_parallel import mappings

        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, p=self.dropout)
        a = torch.nn.functional.linear(x, self.lora_A)
        if self.tp_size > 1:
            a = (mappings.copy_to_tensor_model_parallel_region(a, group=self.tp_group) if self.kind == "column"
                 else mappings.reduce_from_tensor_model_parallel_region(a, group=self.tp_group))
        return torch.nn.functional.linear(a, self.lora_B) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A`` (``weight`` unchanged when the adapter is disabled)."""
        if not self.enabled:
            return weight
        update = (self.lora_B.float() @ self.lora_A.float()) * self.scale
        return (weight.float() + update).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"lora_B": 0} if self.kind == "column" else {"lora_A": 1}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis if self.tp_size > 1 else {}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _add_adapter_output(module, args, kwargs, output):
    adapter = module.adapter
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    result, bias = output
    return result + adapter.delta(x).to(result.dtype), bias


def _checkpoint_adapter_with(linear) -> None:
    """The linear's sharded state: its own as megatron writes it, the adapter's as the adapter shards it
    (megatron's linear would call a TP-split ``lora_B`` replicated)."""
    base = type(linear).sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        state = base(linear, prefix, sharded_offsets, metadata)
        adapter_prefix = f"{prefix}{ADAPTER_ATTR}."
        for key in [k for k in state if k.startswith(adapter_prefix)]:
            del state[key]
        state.update(linear.adapter.sharded_state_dict(adapter_prefix, sharded_offsets, metadata))
        return state

    linear.sharded_state_dict = sharded_state_dict


def _global_module_name(name: str, model: torch.nn.Module) -> str:
    """``decoder.layers.<local i>...`` with the layer's global index (megatron's layer_number - 1)."""
    match = re.match(r"^(decoder\.layers\.)(\d+)(\..*)?$", name)
    if not match:
        return name
    layer = model.decoder.layers[int(match.group(2))]
    return f"{match.group(1)}{layer.layer_number - 1}{match.group(3) or ''}"


def _excluded(global_name: str, patterns) -> bool:
    last = global_name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(global_name, p) or p == last for p in patterns)


def attach_lora(model: torch.nn.Module, spec: LoRASpec) -> list[str]:
    """Freeze every parameter of ``model`` (one GPTModel chunk) and adapt the targeted linears; returns the
    adapted modules' global names. Call before DDP wrapping (DDP gives buffers to trainable parameters only)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        last = name.rsplit(".", 1)[-1]
        if last not in spec.targets:
            continue
        global_name = _global_module_name(name, model)
        if _excluded(global_name, spec.exclude):
            continue
        kind = {ColumnParallelLinear: "column", RowParallelLinear: "row"}.get(type(module))
        if kind is None:
            raise ValueError(f"LoRA cannot adapt {global_name} ({type(module).__name__}): megarl adapts megatron's "
                             f"ColumnParallelLinear/RowParallelLinear (layer_spec=local; not Transformer Engine's "
                             f"fused layernorm linears or grouped experts)")
        if kind != ("column" if last in COLUMN_TARGETS else "row"):
            raise ValueError(f"{global_name} is a {type(module).__name__}, not what {last} is in megatron")
        if kind == "column" and module.gather_output:
            raise ValueError(f"{global_name}: LoRA on a column-parallel linear that gathers its output")
        if module.sequence_parallel:
            raise ValueError(f"{global_name}: LoRA does not take sequence parallelism (megatron.sequence_parallel)")
        weight = module.weight
        out_features, in_features = weight.shape
        module.adapter = LoRAAdapter(
            kind=kind, in_features=in_features, out_features=out_features, spec=spec, tp_group=module.tp_group,
            is_expert=module.is_expert, dtype=weight.dtype, device=weight.device, seed_name=global_name,
            allreduce=getattr(weight, "allreduce", True))
        module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        _checkpoint_adapter_with(module)
        adapted.append(global_name)
    if not adapted:
        raise ValueError(f"LoRA adapted nothing: no module named {spec.targets} is left after exclude={spec.exclude}")
    if getattr(model, "embedding", None) is not None:  # the first pipeline stage; later ones receive a stream that
        model.embedding.register_forward_hook(_stream_needs_grad)  # megatron's schedules mark as needing a gradient
    return adapted


def _stream_needs_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output needs no gradient, and a recomputed layer (megatron's activation
    checkpointing, ``recompute_granularity=full``) whose inputs need none hands back an output that needs none:
    every adapter inside it would be cut off from the loss and never train, silently. So the stream entering the
    decoder asks for its gradient (what transformers' ``enable_input_require_grads`` does for PEFT)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def iter_adapters(model_chunks) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """``(chunk index, local module name, adapted linear)`` of every adapted linear."""
    from megarl.models.bridge import unwrap_model

    for index, chunk in enumerate(model_chunks):
        for name, module in unwrap_model(chunk).named_modules():
            if isinstance(getattr(module, ADAPTER_ATTR, None), LoRAAdapter):
                yield index, name, module


@contextlib.contextmanager
def adapters_disabled(model_chunks) -> Iterator[None]:
    """The base model: every adapter off inside the block (the reference policy of a LoRA actor)."""
    adapters = [module.adapter for _, _, module in iter_adapters(model_chunks)]
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state


def merged_weight(module: torch.nn.Module, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the rollout engine should hold for ``module``'s parameter ``param_name``: the merged weight for an
    adapted linear's ``weight``, the tensor itself otherwise."""
    adapter = getattr(module, ADAPTER_ATTR, None)
    if param_name == "weight" and isinstance(adapter, LoRAAdapter):
        return adapter.merged(tensor)
    return tensor
