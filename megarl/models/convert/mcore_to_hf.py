"""Convert a per-rank megatron checkpoint back to a Hugging Face safetensors checkpoint, streaming.

Plan on headers and meta tensors: for every global parameter the bridge lists, find the rank that
holds it (pipeline stage and expert rank from :mod:`~megarl.models.convert.placement`) and its TP
shards' locations, run the bridge's ``merge_tp`` and ``mcore_to_hf`` on meta tensors to learn the HF
names/shapes, and pack the HF tensors into shards of at most ``max_shard_bytes`` (one global
parameter's HF tensors stay together). Execute: per HF shard, read the TP shards of ONE global
parameter, merge, split into HF tensors, append them to the shard; then the next. Peak memory is a
small multiple of the largest parameter; HF shards are independent tasks (parallel, resumable).

Writes ``model-0000i-of-0000n.safetensors`` + ``config.json`` (+ the tokenizer / generation config
files kept under ``hf_assets/``), and ``model.safetensors.index.json`` LAST, so an interrupted run
never looks like a loadable checkpoint. A checkpoint converted from FP8 comes back in its dequantised
dtype; its ``quantization_config`` is dropped from config.json.

Left out: re-quantising to FP8, writing MTP layers (they were not converted).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

import torch

from megarl.models import mcore_checkpoint as fmt
from megarl.models.convert.execution import OutputFile, Task, hash_plan, note_tensor_written, run_tasks
from megarl.models.convert.hf_index import INDEX_FILE, write_json_atomically
from megarl.models.convert.placement import place_global_tensor
from megarl.models.convert.safetensors_stream import (
    PlannedTensor, StreamingSafetensorsWriter, TensorLocation, fsync_directory, read_safetensors_header,
    read_tensor,
)

logger = logging.getLogger(__name__)

_SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses shards without it


@dataclass(frozen=True)
class Entry:
    global_name: str
    shards: tuple[TensorLocation, ...]  # one per TP rank


def _bridge(metadata: fmt.MCoreCheckpointMetadata):
    from megarl.models.bridge import ModelBridge

    return ModelBridge.from_hf_config(dict(metadata.hf_config), spec=metadata.layer_spec,
                                      expert_layout=metadata.expert_layout,
                                      make_vocab_size_divisible_by=metadata.raw["make_vocab_size_divisible_by"])


def hf_shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_mcore_to_hf(bridge, metadata: fmt.MCoreCheckpointMetadata, ckpt_dir: str,
                     max_shard_bytes: int) -> list[Task]:
    headers: dict[str, dict[str, TensorLocation]] = {}

    def locate(tp_rank: int, pp_rank: int, ep_rank: int, local: str) -> TensorLocation:
        rank = fmt.rank_dir_name(tp_rank, pp_rank, ep_rank)
        info = metadata.raw["ranks"][rank]["tensors"].get(local)
        if info is None:
            raise ValueError(f"{ckpt_dir}/{rank} has no tensor {local!r}")
        if info["file"] not in headers:
            headers[info["file"]], _ = read_safetensors_header(os.path.join(ckpt_dir, info["file"]))
        return headers[info["file"]][local]

    groups: list[tuple[Entry, list[PlannedTensor]]] = []
    for global_name in bridge.iter_global_mcore_names():
        placement = place_global_tensor(bridge, global_name, pp=metadata.pp, ep=metadata.ep)[0]
        shards = tuple(locate(t, placement.pp_rank, placement.ep_rank, placement.local_name)
                       for t in range(metadata.tp))
        metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in shards]
        merged = bridge.merge_tp(global_name, metas)
        planned = [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in bridge.mcore_to_hf(global_name, merged)]
        groups.append((Entry(global_name, shards), planned))
    files: list[list[tuple[Entry, list[PlannedTensor]]]] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group[1])
        if files[-1] and size + group_bytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += group_bytes
    names = hf_shard_names(len(files))
    return [Task(names[i], (OutputFile(names[i], tuple(t for _, planned in part for t in planned)),),
                 tuple(entry for entry, _ in part)) for i, part in enumerate(files)]


@dataclass
class _Context:
    bridge: object
    out_dir: str


def _make_context(ckpt_dir: str, out_dir: str) -> _Context:
    return _Context(_bridge(fmt.read_metadata(ckpt_dir)), out_dir)


def _run_task(context: _Context, task: Task) -> list[tuple[str, int, int]]:
    (out,) = task.files
    writer = StreamingSafetensorsWriter(os.path.join(context.out_dir, out.rel_path), list(out.tensors),
                                        metadata=_SAFETENSORS_METADATA)
    try:
        for entry in task.payload:
            full = context.bridge.merge_tp(entry.global_name, [read_tensor(loc) for loc in entry.shards])
            for hf_name, tensor in context.bridge.mcore_to_hf(entry.global_name, full):
                writer.add(hf_name, tensor)
                note_tensor_written()
            del full
        return [(out.rel_path, *writer.close())]
    except BaseException:
        writer.abort()
        raise


def _hf_config_to_write(metadata: fmt.MCoreCheckpointMetadata) -> dict:
    config = dict(metadata.hf_config)
    if metadata.raw.get("dequantized_fp8"):
        config.pop("quantization_config", None)
        float_dtypes = [d for d in metadata.raw.get("dtypes", []) if d in ("bfloat16", "float16", "float32")]
        if float_dtypes:
            # the widest float dtype present stands for the checkpoint (DeepSeek keeps fp32 router biases)
            dtype = "bfloat16" if "bfloat16" in float_dtypes else float_dtypes[0]
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = dtype
    return config


def convert_mcore_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        max_shard_bytes: int = 5 * 10**9, workers: int = 1) -> dict:
    """Convert; returns the index written. Resumes an interrupted run into the same ``out_dir``."""
    ckpt_dir, out_dir = os.fspath(ckpt_dir), os.fspath(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_bytes}")
    index_path = os.path.join(out_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        raise FileExistsError(f"{index_path} exists: {out_dir} already holds a finished HF checkpoint")
    metadata = fmt.read_metadata(ckpt_dir)
    bridge = _bridge(metadata)
    tasks = plan_mcore_to_hf(bridge, metadata, ckpt_dir, max_shard_bytes)
    plan_hash = hash_plan(tasks, {"direction": "mcore_to_hf", "source": os.path.abspath(ckpt_dir),
                                  "files": {r: e["files"] for r, e in metadata.raw["ranks"].items()}})
    run_tasks(tasks, out_dir=out_dir, plan_hash=plan_hash, workers=workers, make_context=_make_context,
              context_args=(ckpt_dir, out_dir), run_task=_run_task, description="mcore->hf")
    assets_dir = os.path.join(ckpt_dir, fmt.HF_ASSETS_DIR)
    for name in metadata.raw.get("hf_assets", []):
        if name != "config.json":
            shutil.copyfile(os.path.join(assets_dir, name), os.path.join(out_dir, name))
    write_json_atomically(os.path.join(out_dir, "config.json"), _hf_config_to_write(metadata))
    weight_map = {t.name: out.rel_path for task in tasks for out in task.files for t in out.tensors}
    index = {"metadata": {"total_size": sum(out.nbytes for task in tasks for out in task.files)},
             "weight_map": weight_map}
    write_json_atomically(index_path, index)
    fsync_directory(out_dir)
    os.remove(os.path.join(out_dir, ".convert_progress.jsonl"))
    logger.info("wrote %s: %d shards, %d tensors", out_dir, len(tasks), len(weight_map))
    return index
