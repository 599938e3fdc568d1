"""Writing megatron's ``torch_dist`` format one tensor at a time (:mod:`megarl.checkpoint_io.torch_dist_layout`
says what it holds).

:func:`write_part`: torch.distributed.checkpoint's own file writer, driven by a planner whose items are a
layout's chunks and whose ``resolve_data`` produces each one when the writer gets to it, so a part holds one
parameter in memory at a time. A conversion writes several parts (one per task, resumable, in parallel
processes), each a small DCP checkpoint of its own under ``iter_0000000/parts/``, and :func:`merge_parts`
writes the top-level ``.metadata`` that indexes all of them (after checking that the chunks of every key tile
it exactly), megatron's ``metadata.json`` and ``common.pt`` -- only then is the checkpoint complete, and
``latest_checkpointed_iteration.txt`` names it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import pickle
import shutil
from typing import Callable, Iterator, Optional

import torch

from megarl.checkpoint_io.files import write_atomically
from megarl.checkpoint_io.torch_dist_layout import MEGATRON_METADATA, PARTS_DIR, ObjectItem, TensorItem
from megarl.checkpoint_io.torch_dist_reader import dcp_modules, read_dcp_metadata


def _streaming_planner(tensors: list[TensorItem], dtypes: dict[str, torch.dtype], objects: list[ObjectItem],
                       produce: Callable[[TensorItem], torch.Tensor]):
    """A DCP save planner whose write items are ``tensors`` (as chunks of their keys) and ``objects``, each
    produced only when the writer asks for it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    _, meta, planner = dcp_modules()
    by_index = {}
    items = []
    for item in tensors:
        index = meta.MetadataIndex(item.key, torch.Size(item.offset))
        by_index[index] = item
        items.append(planner.WriteItem(
            index=index, type=planner.WriteItemType.SHARD,
            tensor_data=planner.TensorWriteData(
                chunk=meta.ChunkStorageMetadata(offsets=torch.Size(item.offset), sizes=torch.Size(item.chunk_shape)),
                properties=meta.TensorProperties(dtype=dtypes[item.param]), size=torch.Size(item.global_shape))))
    payloads = {}
    for obj in objects:
        index = meta.MetadataIndex(obj.key)
        payloads[index] = obj.payload
        items.append(planner.WriteItem(index=index, type=planner.WriteItemType.BYTE_IO))

    class StreamingSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self):
            self.plan = planner.SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            if write_item.index in payloads:
                return io.BytesIO(payloads[write_item.index])
            return produce(by_index[write_item.index]).contiguous()

    return StreamingSavePlanner()


@contextlib.contextmanager
def _without_record_crc() -> Iterator[None]:
    """``torch.save`` (DCP's item format) computes a CRC32 of every record: a whole extra pass over each tensor's
    bytes that nothing reading the checkpoint checks (``torch.load`` does not; a ``.distcp`` file is a run of
    records at offsets, not a zip archive any tool tests)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # a torch without the switch: records keep their CRC
        yield
        return
    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = saved


def write_part(part_dir: str, tensors: list[TensorItem], dtypes: dict[str, torch.dtype], objects: list[ObjectItem],
               produce: Callable[[TensorItem], torch.Tensor]) -> None:
    """One part: a DCP checkpoint of ``tensors`` (produced in order) and ``objects``, written into a temporary
    directory that becomes ``part_dir`` in one rename once complete."""
    from torch.distributed.checkpoint import FileSystemWriter

    dcp, _, _ = dcp_modules()
    temporary = f"{part_dir}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        with _without_record_crc():
            dcp.save({}, storage_writer=FileSystemWriter(temporary, thread_count=1, sync_files=True),
                     planner=_streaming_planner(tensors, dtypes, objects, produce), no_dist=True)
    except BaseException as error:  # DCP wraps a writer's failure in CheckpointException, a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        free = shutil.disk_usage(os.path.dirname(part_dir)).free  # before the partial part gives its space back
        shutil.rmtree(temporary, ignore_errors=True)
        inner = _first_failure(error)
        needed = sum(math.prod(item.chunk_shape) * dtypes[item.param].itemsize for item in tensors)
        # torch.save on a full disk says "unexpected pos 704 vs 598", not ENOSPC
        if free < needed or (isinstance(inner, OSError) and inner.errno == errno.ENOSPC):
            raise OSError(errno.ENOSPC, f"no space left on the disk holding {part_dir} ({free:,} bytes free, "
                                        f"the part needs {needed:,})") from inner
        raise inner from None
    shutil.rmtree(part_dir, ignore_errors=True)
    os.replace(temporary, part_dir)


def _first_failure(error: BaseException) -> BaseException:
    """The exception a CheckpointException carries for its first failed rank (else ``error`` itself)."""
    failures = getattr(error, "failures", None)
    if not failures:
        return error
    failure = next(iter(failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


def merge_parts(iteration_dir: str, part_names: list[str], *, common: Optional[dict] = None) -> dict:
    """The checkpoint's own ``.metadata`` over every part (their files stay where they are), megatron's
    ``metadata.json`` and ``common.pt``. Refuses a key whose chunks do not tile its tensor exactly. Returns
    {key: global shape} of the tensors."""
    _, meta, _ = dcp_modules()
    state: dict = {}
    storage: dict = {}
    for name in part_names:
        part = read_dcp_metadata(os.path.join(iteration_dir, PARTS_DIR, name))
        for key, value in part.state_dict_metadata.items():
            if key not in state:
                state[key] = value
            elif isinstance(value, meta.TensorStorageMetadata):
                if tuple(value.size) != tuple(state[key].size):
                    raise ValueError(f"{key}: parts disagree on its shape ({tuple(value.size)} vs "
                                     f"{tuple(state[key].size)})")
                state[key] = dataclasses.replace(state[key], chunks=list(state[key].chunks) + list(value.chunks))
        for index, info in part.storage_data.items():
            storage[index] = dataclasses.replace(info, relative_path=f"{PARTS_DIR}/{name}/{info.relative_path}")
    for key, value in state.items():
        if isinstance(value, meta.TensorStorageMetadata):
            covered = sum(math.prod(chunk.sizes) for chunk in value.chunks)
            if covered != math.prod(value.size):
                raise ValueError(f"{key}: its chunks cover {covered} of {math.prod(value.size)} elements: a part is "
                                 f"missing or damaged")
    merged = meta.Metadata(state_dict_metadata=state, storage_data=storage)
    write_atomically(os.path.join(iteration_dir, ".metadata"), pickle.dumps(merged))
    common_bytes = io.BytesIO()
    torch.save(common if common is not None else {"checkpoint_version": 3.0, "iteration": 0}, common_bytes)
    write_atomically(os.path.join(iteration_dir, "common.pt"), common_bytes.getvalue())
    write_atomically(os.path.join(iteration_dir, "metadata.json"), json.dumps(MEGATRON_METADATA).encode())
    return {key: tuple(v.size) for key, v in state.items() if isinstance(v, meta.TensorStorageMetadata)}




