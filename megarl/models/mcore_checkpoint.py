"""The per-rank megatron checkpoint format written by ``converters/hf_to_mcore.py``, and its loader.

A checkpoint is a directory::

    metadata.json                          # written LAST; "complete": true marks a finished checkpoint
    hf_assets/                             # tokenizer/config files copied from the HF source (optional)
    mp_rank_{tp:02d}_{pp:03d}_{ep:03d}/model.safetensors
    mp_rank_{tp:02d}_{pp:03d}_{ep:03d}/model-00001-of-00003.safetensors   # when a rank is split

Each rank directory holds exactly what ``GPTModel.state_dict()`` holds on that (tp, pp, ep) rank with
the given layer spec: rank-LOCAL names (layer index restarting at 0 on every pipeline stage, expert
index local to the expert-parallel rank) and the TP shard (vocabulary padded for TP). ``_extra_state``
entries are not stored (the local spec has none that carry weights).

Expert parallelism: parameters that are not experts are replicated across EP ranks (they are data
parallel there), so they are stored ONCE, under ``ep=000``; the ``ep>0`` directories hold only their
experts. A rank with ``ep_rank=k`` loads non-expert tensors from ``mp_rank_{tp}_{pp}_000`` and experts
from ``mp_rank_{tp}_{pp}_{k}``. Expert tensor parallelism equals TP (megatron's default).

``metadata.json`` records the format version, the HF architecture and config, the parallel sizes, the
pipeline layer split, the vocabulary padding, the layer spec ("local" / "te"), the dtype and, per rank,
every file (size, CRC32) and every tensor (file, global name, expert flag).

Left out: virtual pipeline stages (one model chunk per rank), optimizer state, megatron's
``dist_checkpointing`` format (this is a plain weights format, meant for conversion and initial loads).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from megarl.checkpoint_io.files import write_json_atomically
from megarl.models.bridge import unwrap_model
from megarl.checkpoint_io.safetensors_stream import (
    TensorLocation, file_crc32, read_safetensors_header, read_tensor,
)

FORMAT_NAME = "megarl-mcore-weights"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
HF_ASSETS_DIR = "hf_assets"


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}_{ep_rank:03d}"


def rank_file_names(num_files: int) -> list[str]:
    if num_files == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]


@dataclass(frozen=True)
class StoredTensor:
    local_name: str
    file: str  # relative to the checkpoint directory
    global_name: str
    is_expert: bool


@dataclass
class MCoreCheckpointMetadata:
    raw: dict[str, Any]

    @property
    def tp(self) -> int:
        return int(self.raw["tp"])

    @property
    def pp(self) -> int:
        return int(self.raw["pp"])

    @property
    def ep(self) -> int:
        return int(self.raw["ep"])

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.raw["hf_config"]

    @property
    def layer_spec(self) -> str:
        return self.raw["layer_spec"]

    @property
    def expert_layout(self) -> str:
        return self.raw["expert_layout"]

    @property
    def pipeline_layers(self) -> list[tuple[int, int]]:
        return [tuple(x) for x in self.raw["pipeline_layers"]]

    @property
    def num_local_experts(self) -> Optional[int]:
        return self.raw.get("num_local_experts")

    def rank_tensors(self, tp_rank: int, pp_rank: int, ep_rank: int) -> dict[str, StoredTensor]:
        """Every tensor a model on (tp, pp, ep) loads, including the non-expert ones kept under ep 0."""
        for value, size, what in ((tp_rank, self.tp, "tp_rank"), (pp_rank, self.pp, "pp_rank"),
                                  (ep_rank, self.ep, "ep_rank")):
            if not 0 <= value < size:
                raise ValueError(f"{what}={value} is outside this checkpoint's [0, {size})")
        tensors: dict[str, StoredTensor] = {}
        sources = [rank_dir_name(tp_rank, pp_rank, 0)]
        if ep_rank:
            sources.append(rank_dir_name(tp_rank, pp_rank, ep_rank))
        for source in sources:
            entry = self.raw["ranks"].get(source)
            if entry is None:
                raise ValueError(f"{METADATA_FILE} has no entry for rank directory {source}")
            for local, info in entry["tensors"].items():
                if ep_rank and source != sources[-1] and info["expert"]:
                    continue  # ep 0's own experts
                tensors[local] = StoredTensor(local, info["file"], info["global"], bool(info["expert"]))
        return tensors


def read_metadata(ckpt_dir: str | os.PathLike, *, require_complete: bool = True) -> MCoreCheckpointMetadata:
    path = os.path.join(os.fspath(ckpt_dir), METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a megarl mcore checkpoint, or its conversion "
                                "did not finish")
    with open(path) as handle:
        raw = json.load(handle)
    if raw.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {raw.get('format_version')!r} is not supported "
                         f"(this reader knows {FORMAT_VERSION})")
    if require_complete and raw.get("complete") is not True:
        raise ValueError(f"{path}: checkpoint is not marked complete")
    for key in ("tp", "pp", "ep", "hf_config", "layer_spec", "pipeline_layers", "ranks"):
        if key not in raw:
            raise ValueError(f"{path}: missing field {key!r}")
    return MCoreCheckpointMetadata(raw)


def write_metadata(ckpt_dir: str | os.PathLike, raw: dict[str, Any]) -> None:
    """Publish metadata.json atomically (tmp + fsync + rename): its presence means the checkpoint is whole."""
    write_json_atomically(os.path.join(os.fspath(ckpt_dir), METADATA_FILE), raw, indent=1)


def locate_rank_tensors(ckpt_dir: str | os.PathLike, metadata: MCoreCheckpointMetadata, *, tp_rank: int,
                        pp_rank: int, ep_rank: int) -> dict[str, TensorLocation]:
    """``{local_name: TensorLocation}`` for one rank, reading only the file headers."""
    ckpt_dir = os.fspath(ckpt_dir)
    stored = metadata.rank_tensors(tp_rank, pp_rank, ep_rank)
    headers: dict[str, dict[str, TensorLocation]] = {}
    result: dict[str, TensorLocation] = {}
    for local, entry in stored.items():
        if entry.file not in headers:
            headers[entry.file], _ = read_safetensors_header(os.path.join(ckpt_dir, entry.file))
        location = headers[entry.file].get(local)
        if location is None:
            raise ValueError(f"{entry.file}: {METADATA_FILE} says it holds {local!r}, its header does not")
        result[local] = location
    return result


def _check_layout(model: torch.nn.Module, metadata: MCoreCheckpointMetadata, ckpt_dir: str) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    for field, value in (("tensor_model_parallel_size", metadata.tp), ("pipeline_model_parallel_size", metadata.pp),
                         ("expert_model_parallel_size", metadata.ep)):
        have = getattr(config, field, None)
        if have is not None and int(have) != value:
            raise ValueError(f"{ckpt_dir} was converted for {field}={value}, the model has {have}; "
                             "reconvert with matching --tp/--pp/--ep")


def load_mcore_checkpoint_into(model_chunks: torch.nn.Module | Iterable[torch.nn.Module],
                               ckpt_dir: str | os.PathLike, *, tp_rank: int, pp_rank: int,
                               ep_rank: int) -> int:
    """Copy this rank's tensors into the model, one tensor in memory at a time; returns the count loaded.

    Strict: a parameter/buffer of the model missing from the checkpoint, a checkpoint tensor the model
    does not have, or a shape mismatch raises, naming the tensor. Dtypes may differ (copy_ converts,
    e.g. a bf16 checkpoint into fp32 master weights).
    """
    ckpt_dir = os.fspath(ckpt_dir)
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if len(chunks) != 1:
        raise NotImplementedError(f"got {len(chunks)} model chunks: virtual pipeline stages are not supported by "
                                  "the per-rank checkpoint format (convert with one chunk per stage)")
    model = unwrap_model(chunks[0])
    metadata = read_metadata(ckpt_dir)
    _check_layout(model, metadata, ckpt_dir)
    locations = locate_rank_tensors(ckpt_dir, metadata, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
    targets = {name: value for name, value in model.state_dict(keep_vars=True).items()
               if not name.endswith("_extra_state")}
    where = f"{ckpt_dir} (tp={tp_rank}, pp={pp_rank}, ep={ep_rank})"
    missing = sorted(set(targets) - set(locations))
    unexpected = sorted(set(locations) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{where}: checkpoint and model disagree; missing from checkpoint: {missing[:8]} "
                         f"({len(missing)}), not in the model: {unexpected[:8]} ({len(unexpected)})")
    for name, target in targets.items():
        location = locations[name]
        if tuple(target.shape) != location.shape:
            raise ValueError(f"{where}: {name} has shape {location.shape} in the checkpoint, "
                             f"{tuple(target.shape)} in the model")
    with torch.no_grad():
        for name, target in targets.items():
            target.data.copy_(read_tensor(locations[name]))
    return len(targets)


def read_rank_state_dict(ckpt_dir: str | os.PathLike, *, tp_rank: int, pp_rank: int,
                         ep_rank: int) -> dict[str, torch.Tensor]:
    """Everything one rank holds, in memory (for tests and small models)."""
    metadata = read_metadata(ckpt_dir)
    locations = locate_rank_tensors(ckpt_dir, metadata, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
    return {name: read_tensor(location) for name, location in locations.items()}


def validate_mcore_checkpoint(ckpt_dir: str | os.PathLike, *, check_crc: bool = True) -> list[str]:
    """Problems found (empty list = valid): marker, every rank directory, file sizes/CRCs, header agreement."""
    ckpt_dir = os.fspath(ckpt_dir)
    try:
        metadata = read_metadata(ckpt_dir)
    except (FileNotFoundError, ValueError) as err:
        return [str(err)]
    problems: list[str] = []
    expected_dirs = {rank_dir_name(t, p, e) for t in range(metadata.tp) for p in range(metadata.pp)
                     for e in range(metadata.ep)}
    listed = set(metadata.raw["ranks"])
    for missing in sorted(expected_dirs - listed):
        problems.append(f"rank {missing} is not in {METADATA_FILE}")
    for extra in sorted(listed - expected_dirs):
        problems.append(f"{METADATA_FILE} lists rank {extra}, outside tp={metadata.tp} pp={metadata.pp} "
                        f"ep={metadata.ep}")
    for rank, entry in sorted(metadata.raw["ranks"].items()):
        for file_name, info in entry["files"].items():
            path = os.path.join(ckpt_dir, file_name)
            if not os.path.isfile(path):
                problems.append(f"{file_name}: missing")
                continue
            if os.path.getsize(path) != info["size"]:
                problems.append(f"{file_name}: size {os.path.getsize(path)} != recorded {info['size']}")
                continue
            if check_crc and file_crc32(path) != info["crc32"]:
                problems.append(f"{file_name}: CRC32 differs from the recorded one (corrupted)")
            try:
                header, _ = read_safetensors_header(path)
            except ValueError as err:
                problems.append(str(err))
                continue
            want = {name for name, t in entry["tensors"].items() if t["file"] == file_name}
            if set(header) != want:
                problems.append(f"{file_name}: header tensors differ from {METADATA_FILE} "
                                f"(extra {sorted(set(header) - want)[:4]}, missing {sorted(want - set(header))[:4]})")
    return problems
