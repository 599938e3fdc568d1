"""Convert a megatron ``torch_dist`` checkpoint back to Hugging Face safetensors, streaming.

Megatron's own chunks of each parameter are read from wherever the checkpoint stored them (any layout it was
saved at: converted by ``hf_to_mcore``, or saved by megarl's or Megatron-LM's training) by
:class:`~megarl.checkpoint_io.torch_dist_reader.TorchDistReader`, assembled into the TP=1 parameter and split
into HF tensors by the bridge. Plan on metadata and meta tensors: the HF names and shapes of every parameter,
packed into shards of at most ``max_shard_bytes`` (one parameter's HF tensors stay together). Execute: per HF
shard, one parameter at a time (its chunks, or their bytes mapped in place where an HF tensor is one stored
chunk); peak memory is a small multiple of the largest parameter; HF shards are independent tasks (parallel,
resumable).

Writes ``model-0000i-of-0000n.safetensors`` + ``config.json`` (+ the tokenizer / generation config
files kept under ``hf_assets/``), and ``model.safetensors.index.json`` LAST, so an interrupted run
never looks like a loadable checkpoint. A checkpoint converted from FP8 comes back in its dequantised
dtype; its ``quantization_config`` is dropped from config.json.

Left out: re-quantising to FP8, writing MTP layers (they were not converted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.checkpoint_io.execution import (
    OutputFile, Task, WorkerPool, hash_plan, note_tensor_written, run_tasks,
)
from megarl.checkpoint_io.files import fsync_directory, write_json_atomically
from megarl.checkpoint_io.hf_index import HF_ASSETS_DIR, INDEX_FILE, hf_asset_names
from megarl.checkpoint_io.safetensors_stream import FileBytes, PlannedTensor, StreamingSafetensorsWriter, c_strides
from megarl.models.weight_mapping import TensorConverter

logger = logging.getLogger(__name__)

_SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses shards without it


def hf_shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_hf_shard(context, task: Task, hf_tensors) -> list[tuple[str, int, Optional[int]]]:
    """One HF shard: each entry's HF tensors, ``hf_tensors(entry)`` (name, tensor pairs, one parameter's at a
    time), in the planned order."""
    (out,) = task.files
    writer = StreamingSafetensorsWriter(os.path.join(context.out_dir, out.rel_path), list(out.tensors),
                                        metadata=_SAFETENSORS_METADATA, checksum=False)  # HF keeps no CRC
    try:
        for entry in task.payload:
            for hf_name, tensor in hf_tensors(entry):
                writer.add(hf_name, tensor)
                note_tensor_written()
        return [(out.rel_path, *writer.close())]
    except BaseException:
        writer.abort()
        raise


def _hf_config_to_write(hf_config: dict, record: dict) -> dict:
    config = dict(hf_config)
    if record.get("dequantized_fp8"):
        config.pop("quantization_config", None)
        float_dtypes = [d for d in record.get("dtypes", []) if d in ("bfloat16", "float16", "float32")]
        if float_dtypes:
            # the widest float dtype present stands for the checkpoint (DeepSeek keeps fp32 router biases)
            dtype = "bfloat16" if "bfloat16" in float_dtypes else float_dtypes[0]
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = dtype
    return config


def convert_mcore_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        max_shard_bytes: int = 5 * 10**9, workers: int = 1,
                        hf_config_dir: str | os.PathLike | None = None) -> dict:
    """Convert; returns the index written. Resumes an interrupted run into the same ``out_dir``.

    ``ckpt_dir``: a torch_dist checkpoint -- converted by ``hf_to_mcore`` (its config comes with it), or saved
    by training (megarl's ``global_step_N/actor``, a Megatron-LM ``--save`` directory, or one ``iter_*``
    directory), for which ``hf_config_dir`` names the HF model directory whose config.json (and tokenizer
    files) describe it."""
    ckpt_dir, out_dir = os.fspath(ckpt_dir), os.fspath(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_bytes}")
    index_path = os.path.join(out_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        raise FileExistsError(f"{index_path} exists: {out_dir} already holds a finished HF checkpoint")
    return _convert_torch_dist_to_hf(ckpt_dir, out_dir, max_shard_bytes=max_shard_bytes, workers=workers,
                                     hf_config_dir=None if hf_config_dir is None else os.fspath(hf_config_dir))


def _finish(tasks: list[Task], out_dir: str) -> dict:
    """The index, last: only now does the directory look like a loadable HF checkpoint."""
    weight_map = {t.name: out.rel_path for task in tasks for out in task.files for t in out.tensors}
    index = {"metadata": {"total_size": sum(out.nbytes for task in tasks for out in task.files)},
             "weight_map": weight_map}
    write_json_atomically(os.path.join(out_dir, INDEX_FILE), index)
    fsync_directory(out_dir)
    os.remove(os.path.join(out_dir, ".convert_progress.jsonl"))
    logger.info("wrote %s: %d shards, %d tensors", out_dir, len(tasks), len(weight_map))
    return index


@dataclass(frozen=True)
class DistEntry:
    global_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    items: tuple  # megatron's chunks of this parameter (torch_dist.TensorItem)


def _pack_into_shards(groups: list[tuple[object, list[PlannedTensor]]], max_shard_bytes: int) -> list[Task]:
    files: list[list[tuple[object, list[PlannedTensor]]]] = [[]]
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


def _dist_hf_config(ckpt_dir: str, hf_config_dir: Optional[str]) -> tuple[dict, dict, Optional[str]]:
    """(hf_config, conversion record, directory of the HF assets) for a torch_dist checkpoint."""
    from megarl.checkpoint_io.hf_to_mcore import CONVERSION_FILE, read_hf_config_dict

    record_path = os.path.join(ckpt_dir, CONVERSION_FILE)
    if hf_config_dir is not None:
        return read_hf_config_dict(hf_config_dir), {}, hf_config_dir
    if os.path.isfile(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
        return record["hf_config"], record, os.path.join(ckpt_dir, HF_ASSETS_DIR)
    raise ValueError(f"{ckpt_dir} is a torch_dist checkpoint without {CONVERSION_FILE} (saved by training, not "
                     f"converted): name the HF model directory whose config.json describes it (--hf-config)")


def _run_dist_task(context: "_DistContext", task: Task) -> list[tuple[str, int, Optional[int]]]:
    return _write_hf_shard(context, task, lambda entry: _dist_hf_tensors(context, entry))


def _dist_hf_tensors(context: "_DistContext", entry: DistEntry):
    """The HF tensors of one parameter from megatron's chunks of it. Where each is one contiguous range of one
    stored chunk (all but a dense model's fused q/k/v: SwiGLU's gate and up are fc1's two chunks), it is that
    byte range of the checkpoint's file (:meth:`TorchDistReader.chunk_in_file`), which the shard's writer copies
    file to file in the kernel, or (a chunk not stored as a plain tensor) that range of a read-only mapping of
    the chunk: nothing is read into this process or assembled. Else the parameter is assembled and split."""
    probe = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    planned = list(context.tensors.mcore_to_hf(entry.global_name, probe))
    spans = [_span_in_one_item(tensor, probe, entry.items) for _, tensor in planned]
    if all(span is not None for span in spans):
        chunk: dict = {}  # the chunk in use (one at a time)
        for (hf_name, tensor), (index, start) in zip(planned, spans):
            if index not in chunk:
                chunk = {index: _chunk_source(context.reader, entry.items[index], entry.dtype)}
            source = chunk[index]
            yield hf_name, (source.elements(start, tuple(tensor.shape)) if isinstance(source, FileBytes)
                            else source[start:start + tensor.numel()].view(tensor.shape))
        return
    yield from context.tensors.mcore_to_hf(entry.global_name, _assemble(context.reader, entry))


def _chunk_source(reader, item, dtype: torch.dtype) -> "FileBytes | torch.Tensor":
    """One stored chunk as what a shard's writer copies from: its byte range in its file, or, where it is not
    held as a plain tensor of ``dtype``, a flat read-only mapping of it."""
    in_file = reader.chunk_in_file(item.key, item.offset, item.chunk_shape)
    if in_file is not None and in_file.dtype == dtype:
        return in_file
    return reader.read(item.key, item.offset, item.chunk_shape, mapped=True).reshape(-1)


def _span_in_one_item(tensor: torch.Tensor, probe: torch.Tensor, items: tuple) -> Optional[tuple[int, int]]:
    """``(item index, first element in it)`` where ``tensor`` (an HF tensor made from the meta parameter
    ``probe``) is a contiguous view of ``probe`` inside one contiguous chunk; else ``None``."""
    if not (tensor is probe or tensor._base is probe) or not tensor.is_contiguous():
        return None
    start = tensor.storage_offset()
    for index, item in enumerate(items):
        shape, stride, offset = item.view
        contiguous = tuple(stride) == _whole(shape)[1]
        if contiguous and offset <= start and start + tensor.numel() <= offset + math.prod(shape):
            return index, start - offset
    return None


def _assemble(reader, entry: DistEntry) -> torch.Tensor:
    """The parameter from megatron's chunks of it."""
    if len(entry.items) == 1 and entry.items[0].view == _whole(entry.shape):  # one chunk is the parameter
        item = entry.items[0]
        return reader.read(item.key, item.offset, item.chunk_shape).reshape(entry.shape)
    full = torch.empty(entry.shape, dtype=entry.dtype)
    for item in entry.items:
        shape, stride, storage_offset = item.view
        target = torch.as_strided(full, shape, stride, storage_offset)
        target.copy_(reader.read(item.key, item.offset, item.chunk_shape, mapped=True).reshape(shape))
    return full


def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The (shape, stride, storage offset) view that is the whole contiguous tensor of ``shape``."""
    return tuple(shape), c_strides(shape), 0


@dataclass
class _DistContext:
    """What a worker holds: the bridge's tensor rules (no transformers or megatron to import), the reader."""

    tensors: TensorConverter
    reader: object
    out_dir: str


def _make_dist_context(tensors: TensorConverter, ckpt_dir: str, out_dir: str) -> _DistContext:
    from megarl.checkpoint_io.torch_dist_reader import TorchDistReader

    return _DistContext(tensors, TorchDistReader(ckpt_dir), out_dir)


def _convert_torch_dist_to_hf(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int, workers: int,
                              hf_config_dir: Optional[str]) -> dict:
    from megarl.checkpoint_io.hf_to_mcore import planning_bridge
    from megarl.checkpoint_io.torch_dist_layout import WORKER_MODULES

    hf_config, record, assets_dir = _dist_hf_config(ckpt_dir, hf_config_dir)
    bridge = planning_bridge(hf_config, "local")
    context_args = (bridge.tensors, ckpt_dir, out_dir)
    # the workers start while megatron describes the checkpoint (a meta model: seconds)
    with (WorkerPool(workers, _make_dist_context, context_args, _run_dist_task, preload=WORKER_MODULES)
          if workers > 1 else contextlib.nullcontext()) as pool:
        tasks = _plan_torch_dist_to_hf(ckpt_dir, bridge, max_shard_bytes)
        plan_hash = hash_plan(tasks, {"direction": "torch_dist_to_hf", "source": os.path.abspath(ckpt_dir)})
        run_tasks(tasks, out_dir=out_dir, plan_hash=plan_hash, workers=workers, make_context=_make_dist_context,
                  context_args=context_args, run_task=_run_dist_task, description="torch_dist->hf", pool=pool)
    for name in hf_asset_names(assets_dir) if assets_dir and os.path.isdir(assets_dir) else []:
        if name != "config.json":
            shutil.copyfile(os.path.join(assets_dir, name), os.path.join(out_dir, name))
    write_json_atomically(os.path.join(out_dir, "config.json"), _hf_config_to_write(hf_config, record))
    return _finish(tasks, out_dir)


def _plan_torch_dist_to_hf(ckpt_dir: str, bridge, max_shard_bytes: int) -> list[Task]:
    from megarl.checkpoint_io.torch_dist_layout import checkpoint_layout
    from megarl.checkpoint_io.torch_dist_reader import TorchDistReader

    reader = TorchDistReader(ckpt_dir)
    layout = checkpoint_layout(bridge)
    groups = []
    for name, items in layout.items_of().items():
        missing = [item.key for item in items if item.key not in reader.tensors]
        if missing:
            raise ValueError(f"{reader.path} has no {missing[0]!r} ({name}): it is not a checkpoint of the model "
                             f"config.json describes")
        vocab_rows = bridge.tensors.rule(name).vocab_size  # padded per the saving layout's TP size: more rows
        for item in items:
            stored, described = tuple(reader.shape(item.key)), tuple(item.global_shape)
            if stored != described and not (vocab_rows and stored[1:] == described[1:] and stored[0] >= vocab_rows):
                raise ValueError(f"{reader.path}: {item.key!r} is {stored}, but config.json describes {described}: "
                                 f"config and checkpoint do not match")
        dtype = reader.dtype(items[0].key)
        merged = torch.empty(layout.param_shapes[name], dtype=dtype, device="meta")
        planned = [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in bridge.mcore_to_hf(name, merged)]
        groups.append((DistEntry(name, tuple(layout.param_shapes[name]), dtype, tuple(items)), planned))
    order = {name: i for i, name in enumerate(bridge.iter_global_mcore_names())}
    groups.sort(key=lambda group: order[group[0].global_name])
    return _pack_into_shards(groups, max_shard_bytes)
