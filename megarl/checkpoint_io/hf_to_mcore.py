"""Convert a Hugging Face safetensors checkpoint into megatron-core's ``torch_dist`` format, streaming.

Plan first: megatron's own chunks of every parameter (:func:`~megarl.checkpoint_io.torch_dist_layout.checkpoint_layout`,
the model built at TP = PP = EP = 1 on the meta device) and, on headers only, the HF source tensors each
parameter is made of, with its full shape from the bridge's own fuse functions run on ``device="meta"``
tensors. Whole parameters are grouped into parts of about ``max_file_bytes``; a part is one task. Then execute:
a task reads the HF tensors of ONE parameter (pread, or mapped in place where a chunk is a plain slice of one
source), dequantises FP8 blocks if needed, fuses them, and hands megatron's chunks to torch.distributed.checkpoint's
writer (:func:`~megarl.checkpoint_io.torch_dist_writer.write_part`); the tensor is dropped before the next one is
read. Peak memory per worker is therefore a small multiple (about 3x) of the largest single parameter,
independent of model size and file size. ``memory_budget_bytes`` caps the number of concurrent workers
accordingly (and refuses a budget smaller than one worker needs). Models at any TP/PP/EP load the result through
megatron's resharding.

DeepSeek-V3: ``weight`` float8_e4m3fn + ``weight_scale_inv`` are dequantised to bf16 (or ``dtype``);
the multi-token-prediction layers (``model.layers.{>= num_hidden_layers}``) are skipped and counted in
the log. Every other HF tensor must be consumed: leftovers raise, naming them.

megarl's older per-rank format (fixed to one TP/PP/EP, read by nothing but megarl's own converter) is retired:
it wrote 1.2x faster, and nothing read it.

Left out: MTP conversion, FP8 storage (weights are written in bf16/fp32).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.checkpoint_io.execution import (
    OutputFile, Task, WorkerPool, hash_plan, note_tensor_written, run_tasks,
)
from megarl.checkpoint_io.fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize_fp8_blockwise, fp8_block_size
from megarl.checkpoint_io.hf_index import HF_ASSETS_DIR, hf_asset_names, index_hf_safetensors
from megarl.checkpoint_io.safetensors_stream import (
    PlannedTensor, TensorLocation, map_rows, read_rows_into, read_tensor,
)
from megarl.models.weight_mapping import TensorConverter

logger = logging.getLogger(__name__)

# Sources + fused full tensor + TP shards are alive together while one parameter is converted.
TRANSIENT_COPIES = 3


@dataclass(frozen=True)
class Source:
    hf_name: str
    location: TensorLocation
    scale: Optional[TensorLocation] = None  # the FP8 block scales, when the weight is FP8


@dataclass(frozen=True)
class Entry:
    global_name: str
    sources: tuple[Source, ...]
    full_nbytes: int


@dataclass(frozen=True)
class ConversionOptions:
    dtype: Optional[torch.dtype] = None  # None: keep each HF dtype (FP8 -> bfloat16)
    max_file_bytes: int = 4 * 10**9  # about this many bytes per part


def read_hf_config_dict(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    with open(path) as handle:
        return json.load(handle)


def planning_bridge(hf_config: dict, spec: str):
    """The bridge a conversion plans with: keys and shapes only, every one checked against the tensors it is
    converted from, so config.json's own fields serve (:class:`~megarl.models.hf_config.ConfigFields`: no
    transformers to import)."""
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_config import ConfigFields

    return ModelBridge.from_hf_config(ConfigFields(hf_config), spec=spec)


def _output_dtype(location: TensorLocation, options: ConversionOptions) -> torch.dtype:
    if options.dtype is not None and (location.dtype.is_floating_point or location.dtype in FP8_DTYPES):
        return options.dtype
    return torch.bfloat16 if location.dtype in FP8_DTYPES else location.dtype


def _sources_for(bridge, global_name: str, locations: dict[str, TensorLocation]) -> tuple[Source, ...]:
    sources = []
    for hf_name in bridge.hf_names_for(global_name):
        location = locations.get(hf_name)
        if location is None:
            raise ValueError(f"HF checkpoint has no tensor {hf_name!r} (needed for {global_name})")
        scale = locations.get(hf_name + SCALE_SUFFIX)
        if location.dtype in FP8_DTYPES and scale is None:
            raise ValueError(f"{hf_name} is {location.dtype} but there is no {hf_name + SCALE_SUFFIX} "
                             "(only block-wise FP8 with scale_inv is supported)")
        sources.append(Source(hf_name, location, scale if location.dtype in FP8_DTYPES else None))
    return tuple(sources)


def _planned(bridge, global_name: str, locations: dict[str, TensorLocation], options: ConversionOptions,
             consumed: set[str]) -> tuple[tuple[Source, ...], torch.Tensor]:
    """A global parameter's HF sources (noted in ``consumed``) and, on the meta device, the full tensor they make."""
    sources = _sources_for(bridge, global_name, locations)
    consumed.update(s.hf_name for s in sources)
    consumed.update(s.scale.name for s in sources if s.scale is not None)
    metas = {s.hf_name: torch.empty(s.location.shape, dtype=_output_dtype(s.location, options), device="meta")
             for s in sources}
    return sources, bridge.hf_to_mcore(global_name, metas)


def _check_all_consumed(bridge, locations: dict[str, TensorLocation], consumed: set[str]) -> None:
    leftovers = sorted(set(locations) - consumed)
    skipped_mtp = [n for n in leftovers if bridge.is_skipped_hf_name(n)]
    tied_head = [n for n in leftovers if n == "lm_head.weight" and bridge.tied_embeddings]
    unknown = [n for n in leftovers if n not in skipped_mtp and n not in tied_head]
    if unknown:
        raise ValueError(f"HF checkpoint has {len(unknown)} tensor(s) the {bridge.hf_architecture} bridge does "
                         f"not map: {unknown[:8]}")
    if skipped_mtp:
        logger.info("skipped %d multi-token-prediction tensor(s) (model.layers.%d+)", len(skipped_mtp),
                    bridge.dims.num_layers)
    if tied_head:
        logger.info("skipped lm_head.weight: embeddings are tied")


def peak_bytes_per_worker(tasks: list[Task]) -> int:
    return TRANSIENT_COPIES * max(entry.full_nbytes for task in tasks for entry in task.payload.entries)


# ---------------------------------------------------------------------------------------- execution
@dataclass
class _Context:
    """What a worker holds: plain data, so that it starts without importing transformers or megatron."""

    tensors: TensorConverter
    options: ConversionOptions
    out_dir: str
    fp8_block: tuple[int, int]


def _context_args(bridge, hf_config: dict, options: ConversionOptions, out_dir: str) -> tuple:
    return bridge.tensors, options, out_dir, fp8_block_size(hf_config.get("quantization_config"))


def _load_source(source: Source, context: _Context) -> torch.Tensor:
    tensor = read_tensor(source.location)
    out_dtype = _output_dtype(source.location, context.options)
    if source.scale is not None:
        return dequantize_fp8_blockwise(tensor, read_tensor(source.scale), dtype=out_dtype,
                                        block=context.fp8_block, name=source.hf_name)
    return tensor if tensor.dtype == out_dtype else tensor.to(out_dtype)


def _copy_hf_assets(hf_dir: str, out_dir: str) -> list[str]:
    """Tokenizer / generation config files travel with the checkpoint so mcore_to_hf can restore them."""
    copied = hf_asset_names(hf_dir)
    target = os.path.join(out_dir, HF_ASSETS_DIR)
    for name in copied:
        os.makedirs(target, exist_ok=True)
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(target, name))
    return copied


def _workers_within_budget(tasks: list[Task], workers: int, memory_budget_bytes: Optional[int]) -> int:
    per_worker = peak_bytes_per_worker(tasks)
    if memory_budget_bytes is None:
        return workers
    if per_worker > memory_budget_bytes:
        raise ValueError(f"memory budget {memory_budget_bytes / 2**20:.0f} MiB is below what one worker needs "
                         f"(~{per_worker / 2**20:.0f} MiB: {TRANSIENT_COPIES}x the largest parameter)")
    fitting = max(1, memory_budget_bytes // per_worker)
    if fitting < workers:
        logger.info("memory budget allows %d concurrent worker(s), not %d", fitting, workers)
    return int(min(workers, fitting))


def convert_hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        dtype: Optional[torch.dtype] = None, workers: int = 1,
                        memory_budget_bytes: Optional[int] = None, max_file_bytes: int = 4 * 10**9) -> dict:
    """Convert; returns the conversion's record (``megarl_conversion.json``). Resumes an interrupted run into
    the same ``out_dir``. One checkpoint for every TP/PP/EP layout: megatron reshards it when it loads."""
    hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return _convert_to_torch_dist(hf_dir, out_dir, dtype=dtype, workers=workers,
                                  memory_budget_bytes=memory_budget_bytes, max_file_bytes=max_file_bytes)


# ---------------------------------------------------------------------------------------- torch_dist
CONVERSION_FILE = "megarl_conversion.json"  # beside Megatron-LM's tracker: what mcore_to_hf needs to go back


@dataclass(frozen=True)
class PartPayload:
    entries: tuple[Entry, ...]  # the parameters of this part, in order
    items: tuple  # their TensorItems (megatron's chunks), in the same order
    objects: tuple  # megatron's ShardedObjects (the first part carries them)
    dtypes: dict  # parameter -> dtype written


def plan_torch_dist(bridge, layout, locations: dict[str, TensorLocation], options: ConversionOptions) -> list[Task]:
    """Tasks that each write one part of the checkpoint: whole parameters, about ``max_file_bytes`` each."""
    from megarl.checkpoint_io.torch_dist_layout import ITERATION_DIR, PARTS_DIR

    by_param = layout.items_of()
    consumed: set[str] = set()
    parts: list[list[tuple[Entry, torch.dtype]]] = [[]]
    part_bytes = 0
    for name in bridge.iter_global_mcore_names():
        sources, full = _planned(bridge, name, locations, options, consumed)
        expected = layout.param_shapes[name]
        if tuple(full.shape) != tuple(expected):
            raise ValueError(f"{name}: the HF tensors {[s.hf_name for s in sources]} make a {tuple(full.shape)} "
                             f"tensor, but config.json describes {tuple(expected)}: config and weights do not match")
        nbytes = full.numel() * full.element_size()
        if parts[-1] and part_bytes + nbytes > options.max_file_bytes:
            parts.append([])
            part_bytes = 0
        parts[-1].append((Entry(name, sources, nbytes), full.dtype))
        part_bytes += nbytes
    _check_all_consumed(bridge, locations, consumed)
    tasks = []
    for index, part in enumerate(parts):
        dtypes = {entry.global_name: dtype for entry, dtype in part}
        items = tuple(item for entry, _ in part for item in by_param[entry.global_name])
        planned = tuple(PlannedTensor(f"{item.key}@{list(item.offset)}", dtypes[item.param], item.chunk_shape)
                        for item in items)
        name = f"part{index:05d}"
        tasks.append(Task(name, (OutputFile(f"{ITERATION_DIR}/{PARTS_DIR}/{name}/.metadata", planned),),
                          PartPayload(tuple(e for e, _ in part), items, tuple(layout.objects) if index == 0 else (),
                                      dtypes)))
    return tasks


def _read_chunk_in_place(item, entry: Entry, dtype: torch.dtype, context: _Context) -> Optional[torch.Tensor]:
    """Megatron's chunk ``item`` of ``entry``'s parameter (planned as ``dtype``) read straight from the HF files
    into a tensor of its own: each HF row lands where the fusion puts it, so q/k/v and gate/up are fused without
    building the HF tensors, the fused parameter, or the copy of a chunk that DCP's writer would clone out of it;
    a chunk that is one stored row range is mapped instead (:func:`map_rows`), so it is never copied to memory.
    ``None`` where that does not apply (a source to convert to ``dtype``, FP8 to dequantize, a chunk that is not
    a row range)."""
    sources = {source.hf_name: source.location for source in entry.sources}
    if any(s.scale is not None or s.location.dtype != dtype for s in entry.sources):
        return None
    shape, stride, storage_offset = item.view
    row_numel = max(math.prod(shape[1:]), 1)
    contiguous_stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    if not shape or tuple(stride) != contiguous_stride or storage_offset % row_numel:
        return None
    first = storage_offset // row_numel
    runs = context.tensors.row_runs(entry.global_name, {name: loc.shape[0] for name, loc in sources.items()})
    reads = []  # (run, first and last+1 row of the chunk it fills)
    for run in runs:
        lo, hi = max(run.dst_row, first), min(run.dst_row + run.rows, first + shape[0])
        if lo < hi:
            if tuple(sources[run.hf_name].shape[1:]) != tuple(shape[1:]):
                return None
            reads.append((run, lo, hi))
    padded = sum(hi - lo for _, lo, hi in reads) < shape[0]  # the vocabulary's padding rows stay zero
    if len(reads) == 1 and not padded:  # one stored row range: written straight from the page cache
        run, lo, hi = reads[0]
        return map_rows(sources[run.hf_name], run.src_row + lo - run.dst_row, hi - lo).reshape(item.chunk_shape)
    out = torch.zeros(shape, dtype=dtype) if padded else torch.empty(shape, dtype=dtype)
    for run, lo, hi in reads:
        read_rows_into(sources[run.hf_name], out[lo - first:hi - first], run.src_row + lo - run.dst_row)
    return out.reshape(item.chunk_shape)


def _run_torch_dist_task(context: _Context, task: Task) -> list[tuple[str, int, int]]:
    import zlib

    from megarl.checkpoint_io.torch_dist_writer import write_part

    (out,) = task.files
    payload: PartPayload = task.payload
    entries = {entry.global_name: entry for entry in payload.entries}
    current: dict[str, torch.Tensor] = {}

    def produce(item) -> torch.Tensor:
        chunk = _read_chunk_in_place(item, entries[item.param], payload.dtypes[item.param], context)
        if chunk is None:
            if item.param not in current:  # parameters come one after another: one is held at a time
                current.clear()
                entry = entries[item.param]
                hf_tensors = {s.hf_name: _load_source(s, context) for s in entry.sources}
                current[item.param] = context.tensors.hf_to_mcore(item.param, hf_tensors).contiguous()
            chunk = item.take(current[item.param])
        note_tensor_written()
        return chunk

    part_dir = os.path.join(context.out_dir, os.path.dirname(out.rel_path))
    write_part(part_dir, list(payload.items), payload.dtypes, list(payload.objects), produce)
    with open(os.path.join(context.out_dir, out.rel_path), "rb") as handle:
        data = handle.read()
    return [(out.rel_path, len(data), zlib.crc32(data))]


def _convert_to_torch_dist(hf_dir: str, out_dir: str, *, dtype: Optional[torch.dtype], workers: int,
                           memory_budget_bytes: Optional[int], max_file_bytes: int) -> dict:
    from megarl.checkpoint_io.files import TRACKER_FILE
    from megarl.checkpoint_io.torch_dist_layout import WORKER_MODULES

    if os.path.isfile(os.path.join(out_dir, TRACKER_FILE)):
        raise FileExistsError(f"{os.path.join(out_dir, TRACKER_FILE)} exists: {out_dir} already holds a finished "
                              f"checkpoint")
    started = time.perf_counter()
    hf_config = read_hf_config_dict(hf_dir)
    options = ConversionOptions(dtype=dtype, max_file_bytes=max_file_bytes)
    bridge = planning_bridge(hf_config, "local")  # the checkpoint's keys are the same for the TE spec
    context_args = _context_args(bridge, hf_config, options, out_dir)
    # the workers start while megatron describes the checkpoint (a meta model: seconds)
    with (WorkerPool(workers, _Context, context_args, _run_torch_dist_task, preload=WORKER_MODULES)
          if workers > 1 else contextlib.nullcontext()) as pool:
        metadata, phases = _convert_to_torch_dist_with(hf_dir, out_dir, bridge, hf_config, options, context_args,
                                                       workers, memory_budget_bytes, pool, started)
        closing = time.perf_counter()
    phases["workers stopped"] = time.perf_counter() - closing
    logger.info("hf->torch_dist took %.1f s: %s", time.perf_counter() - started,
                ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    return metadata


def _convert_to_torch_dist_with(hf_dir: str, out_dir: str, bridge, hf_config: dict, options: ConversionOptions,
                                context_args: tuple, workers: int, memory_budget_bytes: Optional[int],
                                pool: Optional[WorkerPool], started: float) -> tuple[dict, dict[str, float]]:
    """The conversion, and how long its phases took (planning, tasks, merging; a user's first question
    about a slow run is which of them it was)."""
    from megarl.checkpoint_io.files import mark_latest
    from megarl.checkpoint_io.torch_dist_layout import ITERATION_DIR, PARTS_DIR, checkpoint_layout
    from megarl.checkpoint_io.torch_dist_writer import merge_parts

    layout = checkpoint_layout(bridge)
    locations = index_hf_safetensors(hf_dir)
    tasks = plan_torch_dist(bridge, layout, locations, options)
    workers = _workers_within_budget(tasks, workers, memory_budget_bytes)
    plan_hash = hash_plan(tasks, {"direction": "hf_to_torch_dist", "options": options.__dict__, "sources": sorted(
        (loc.name, os.path.basename(loc.path), loc.start, loc.end) for loc in locations.values())})
    parts_root = os.path.join(out_dir, ITERATION_DIR, PARTS_DIR)
    if os.path.isdir(parts_root):  # parts an interrupted run was writing when it stopped
        for name in os.listdir(parts_root):
            if ".tmp-" in name:
                shutil.rmtree(os.path.join(parts_root, name), ignore_errors=True)
    phases = {"planning (config, megatron's layout, source index)": time.perf_counter() - started}
    stats = run_tasks(tasks, out_dir=out_dir, plan_hash=plan_hash, workers=workers, make_context=_Context,
                      context_args=context_args, run_task=_run_torch_dist_task, description="hf->torch_dist",
                      pool=pool)
    phases["tasks"] = stats.seconds
    merging = time.perf_counter()
    shapes = merge_parts(os.path.join(out_dir, ITERATION_DIR), [task.task_id for task in tasks])
    assets = _copy_hf_assets(hf_dir, out_dir)
    metadata = {"format": "torch_dist", "arch": bridge.hf_architecture, "hf_config": hf_config,
                "make_vocab_size_divisible_by": bridge.make_vocab_size_divisible_by,
                "dtypes": sorted({str(d).removeprefix("torch.") for t in tasks for d in t.payload.dtypes.values()}),
                "dequantized_fp8": any(loc.dtype in FP8_DTYPES for loc in locations.values()),
                "hf_assets": assets, "tensors": len(shapes), "parts": len(tasks)}
    with open(os.path.join(out_dir, CONVERSION_FILE), "w") as handle:
        json.dump(metadata, handle, indent=1, sort_keys=True)
    mark_latest(out_dir)  # last: the checkpoint is complete
    os.remove(os.path.join(out_dir, ".convert_progress.jsonl"))
    phases["merging and marking"] = time.perf_counter() - merging
    logger.info("wrote %s: %d parts, %d keys, %.2f GB (%d parts resumed as done)", out_dir, len(tasks), len(shapes),
                stats.bytes_written / 1e9, stats.tasks_skipped)
    return metadata, phases
