"""Read HF safetensors checkpoints lazily and fill this rank's megatron shards from them.

:class:`HFCheckpointReader` opens ``model.safetensors`` or a sharded ``model.safetensors.index.json``
and reads one tensor at a time. :func:`load_hf_weights` walks the parameters of this rank's model
chunks in order, maps each local name to its global name (PP layer offset, EP expert offset), reads the
HF tensors it is made of, fuses them into the full megatron tensor, cuts this rank's TP shard and copies
it in. Only one full tensor exists at a time. The checkpoint is checked against the bridge first:
missing or unexpected HF tensors raise, naming them (MTP layers are skipped by design).

Left out: writing checkpoints (converters / weight sync do that), non-safetensors formats, fp8 dequant.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def open_safetensors(path: str):
    """``safe_open(path)``, with an error that names the file when its header or size is broken (a truncated
    download or copy: safetensors' own message does not say which file)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:
        size = os.path.getsize(path)
        raise ValueError(f"{path} ({size} bytes) is not a readable safetensors file, truncated or corrupt "
                         f"({exc}); copy or download it again") from exc


class HFCheckpointReader:
    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = os.fspath(hf_dir)
        index = os.path.join(self.hf_dir, INDEX_FILE)
        single = os.path.join(self.hf_dir, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object")
            self._file_of = dict(weight_map)
        elif os.path.isfile(single):
            with open_safetensors(single) as handle:
                self._file_of = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.hf_dir}")
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        return self._handle_for(name).get_tensor(name)

    def _handle_for(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.hf_dir}")
        file = self._file_of[name]
        if file not in self._handles:
            path = os.path.join(self.hf_dir, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{INDEX_FILE} names {file} for {name!r}, but {path} does not exist")
            self._handles[file] = open_safetensors(path)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the safetensors header (no data read)."""
        return tuple(self._handle_for(name).get_slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()


def check_checkpoint_names(bridge, reader: HFCheckpointReader) -> None:
    """Raise if the checkpoint lacks a tensor the bridge needs, or holds one it does not know."""
    present = set(reader.names())
    needed = set(bridge.iter_hf_names())
    missing = sorted(needed - present)
    optional = {"lm_head.weight"} if bridge.tied_embeddings else set()
    unexpected = sorted(n for n in present - needed - optional if not bridge.is_skipped_hf_name(n))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:5]}")
    if problems:
        raise ValueError(f"HF checkpoint {reader.hf_dir} does not match {bridge.hf_architecture}: "
                         + "; ".join(problems))


def iter_loadable_tensors(model) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters plus the router ``expert_bias`` buffers (megatron keeps those as buffers); LoRA adapters are
    not in an HF checkpoint."""
    from megarl.models.lora import is_adapter_param

    yield from ((name, p) for name, p in model.named_parameters() if not is_adapter_param(name))
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer


def layer_offset_of(model) -> int:
    """Global index of the chunk's first decoder layer (megatron's layer_number is global, 1-based)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return layers[0].layer_number - 1


def load_hf_weights(model_chunks: list, hf_dir: str | os.PathLike, bridge, *, tp_rank: Optional[int] = None,
                    tp_size: Optional[int] = None, etp_rank: Optional[int] = None, etp_size: Optional[int] = None,
                    ep_rank: Optional[int] = None, ep_size: Optional[int] = None,
                    exclude_prefixes: tuple[str, ...] = ()) -> dict[str, int]:
    """Fill every parameter of ``model_chunks`` (this rank's GPTModels) from the HF checkpoint.

    Parallel ranks default to megatron's parallel_state. Local names starting with one of
    ``exclude_prefixes`` are left as they are (the critic's freshly initialised value head
    ``output_layer.``). Returns counts (``params``, ``hf_tensors_read``).
    """
    from megatron.core import parallel_state as mpu

    tp_rank = mpu.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = mpu.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    etp_rank = mpu.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    etp_size = mpu.get_expert_tensor_parallel_world_size() if etp_size is None else etp_size
    ep_rank = mpu.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    ep_size = mpu.get_expert_model_parallel_world_size() if ep_size is None else ep_size
    if bridge.dims.num_experts and bridge.dims.num_experts % ep_size:
        raise ValueError(f"{bridge.dims.num_experts} experts do not split over expert_parallel={ep_size}")
    num_local_experts = bridge.dims.num_experts // ep_size if bridge.dims.num_experts else None

    reader = HFCheckpointReader(hf_dir)
    check_checkpoint_names(bridge, reader)
    counts = {"params": 0, "hf_tensors_read": 0}
    try:
        for model in model_chunks:
            offset = layer_offset_of(model)
            for local_name, target in iter_loadable_tensors(model):
                if local_name.startswith(exclude_prefixes):
                    continue
                global_name = bridge.local_to_global_name(local_name, layer_offset=offset, ep_rank=ep_rank,
                                                          num_local_experts=num_local_experts)
                hf_tensors = {n: reader.get(n) for n in bridge.hf_names_for(global_name)}
                counts["hf_tensors_read"] += len(hf_tensors)
                full = bridge.hf_to_mcore(global_name, hf_tensors)
                del hf_tensors
                if bridge.is_expert_param(global_name):
                    shard = bridge.shard_tp(global_name, full, etp_rank, etp_size)
                else:
                    shard = bridge.shard_tp(global_name, full, tp_rank, tp_size)
                if tuple(shard.shape) != tuple(target.shape):
                    raise ValueError(f"{local_name} (global {global_name}): checkpoint gives shard shape "
                                     f"{tuple(shard.shape)}, the model holds {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(shard.to(dtype=target.dtype))
                counts["params"] += 1
    finally:
        reader.close()
    logger.info("loaded %d tensors from %s (%d HF tensors read)", counts["params"], hf_dir, counts["hf_tensors_read"])
    return counts
