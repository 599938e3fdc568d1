"""megatron-core's ``torch_dist`` checkpoint format (what Megatron-LM's ``--load`` and
``dist_checkpointing.load`` read), written and read one tensor at a time.

**What the checkpoint holds** is whatever megatron says a model's ``sharded_state_dict()`` is: its keys
(layers stacked on a leading axis for uniform decoders, per layer otherwise), global shapes, and how each
parameter maps onto them (SwiGLU's ``linear_fc1`` is two chunks, experts sit on an expert axis).
:func:`checkpoint_layout` asks megatron: it builds the model at TP = PP = EP = 1 on the meta device (no memory,
seconds even for 671B) and records every chunk as a :class:`TensorItem` -- key, global shape, offset, and
which global megarl parameter (the bridge's names) it is a view of. Models built at any other layout load
the result through megatron's resharding; vocabulary padding that differs by TP is megatron's
``allow_shape_mismatch`` on embeddings and output layers.

**Writing** (:func:`write_part`): torch.distributed.checkpoint's own file writer, driven by a planner whose
items are those chunks and whose ``resolve_data`` produces each one when the writer gets to it, so a part
holds one parameter in memory at a time. A conversion writes several parts (one per task, resumable, in
parallel processes), each a small DCP checkpoint of its own under ``iter_0000000/parts/``, and
:func:`merge_parts` writes the top-level ``.metadata`` that indexes all of them (after checking that the
chunks of every key tile it exactly), megatron's ``metadata.json`` and ``common.pt`` -- only then is the
checkpoint complete, and ``latest_checkpointed_iteration.txt`` names it.

**Reading** (:class:`TorchDistReader`): any torch_dist checkpoint (converted, or saved by megarl's or
Megatron-LM's training at any layout): a box of a key is assembled from the stored chunks that overlap it,
each read from its byte range in its file (``torch.load`` of one item, as DCP's reader does), or, for a caller
that only passes the bytes on, mapped or located (the tensor's bytes in the file, where the item is a plain
tensor: :meth:`TorchDistReader.chunk_in_file`).

Left out: optimizer state (conversion is of weights), FP8 storage (weights are written in bf16/fp32).
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
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megarl.checkpoint_files import RELEASE, TRACKER_FILE, tracked_iteration, write_atomically
from megarl.models.convert.safetensors_stream import FileBytes, c_strides, map_bytes

ITERATION_DIR = "iter_0000000"
PARTS_DIR = "parts"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}

# what a conversion worker reading or writing this format imports: loaded once, in the fork server
WORKER_MODULES = ("megarl.models.convert.torch_dist", "torch.distributed.checkpoint")


@dataclass(frozen=True)
class TensorItem:
    key: str  # megatron's sharded key (the DCP fully qualified name)
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the leading axes megatron prepends (layer, expert) are 1 here
    param: str  # the bridge's global megatron name this chunk is a view of (a TP=PP=EP=1 model's parameter)
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, stride, storage offset) into that parameter

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk of the parameter ``full`` (contiguous, the parameter's shape)."""
        shape, stride, storage_offset = self.view
        return torch.as_strided(full, shape, stride, storage_offset).reshape(self.chunk_shape)


@dataclass(frozen=True)
class ObjectItem:
    key: str  # megatron's unique key of a ShardedObject (key/shard_<offset>_<shape>)
    payload: bytes  # torch.save of [the object], as megatron writes it


@dataclass
class CheckpointLayout:
    tensors: list[TensorItem]
    objects: list[ObjectItem]
    param_shapes: dict[str, tuple[int, ...]]

    def items_of(self) -> dict[str, list[TensorItem]]:
        by_param: dict[str, list[TensorItem]] = {}
        for item in self.tensors:
            by_param.setdefault(item.param, []).append(item)
        return by_param


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """megatron's parallel state for one process (TP = PP = EP = 1), set up if this process has none and torn
    down after; building a model needs it."""
    import torch.distributed as dist
    from datetime import timedelta

    from megatron.core import parallel_state as mpu

    created_group = not dist.is_initialized()
    if created_group:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    created_state = not mpu.model_parallel_is_initialized()
    if created_state:
        mpu.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if created_state:
            mpu.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def checkpoint_layout(bridge) -> CheckpointLayout:
    """Every chunk megatron's ``sharded_state_dict`` describes for ``bridge``'s model (see the module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from megarl.models.parallel_layout import ParallelLayout

    if not torch.cuda.is_available():
        from megarl.models.cpu_compat import enable_cpu_compat

        enable_cpu_compat()  # MLA and MoE layers assume CUDA while they are built
    with single_process_megatron():
        # the token dispatcher does not change the keys; the all-to-all one wants a CUDA stream at construction
        overrides = {"moe_token_dispatcher_type": "allgather"} if bridge.architecture.has_moe else {}
        config = bridge.transformer_config(layout=ParallelLayout(), perform_initialization=False,
                                           fused_kernels=False, **overrides)
        with torch.device("meta"):
            model = bridge.build_model(config=config, pre_process=True, post_process=True)
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(b): n for n, b in model.named_buffers()})
    wanted = set(bridge.iter_global_mcore_names())
    tensors, objects, seen = [], [], set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor):
            if value.flattened_range is not None or any(r != 0 for r in _replica(value.replica_id)):
                raise RuntimeError(f"{value.key}: a TP=PP=EP=1 model should hold whole, main-replica chunks")
            base = value.data if value.data._base is None else value.data._base
            param = names.get(id(base))
            if param not in wanted:
                raise RuntimeError(f"{value.key} is a view of {param!r}, which the {bridge.hf_architecture} bridge "
                                   f"does not map")
            seen.add(param)
            chunk_shape = (1,) * value.prepend_axis_num + tuple(value.local_shape)
            tensors.append(TensorItem(value.key, tuple(value.global_shape), tuple(value.global_offset), chunk_shape,
                                      param, (tuple(value.data.shape), tuple(value.data.stride()),
                                              value.data.storage_offset())))
        elif isinstance(value, ShardedObject):
            buffer = io.BytesIO()
            torch.save([value.data], buffer)  # megatron stores a key's objects as one list
            objects.append(ObjectItem(value.unique_key, buffer.getvalue()))
    missing = sorted(wanted - seen)
    if missing:
        raise RuntimeError(f"megatron's sharded state dict has no chunk of {missing[:5]}")
    shapes = {n: tuple(p.shape) for n, p in list(model.named_parameters()) + list(model.named_buffers())
              if n in wanted}
    return CheckpointLayout(tensors, objects, shapes)


def _replica(replica_id) -> tuple:
    return replica_id if isinstance(replica_id, tuple) else (replica_id,)


# ------------------------------------------------------------------------------------------------ writing
def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as meta
    from torch.distributed.checkpoint import planner

    return dcp, meta, planner


def _streaming_planner(tensors: list[TensorItem], dtypes: dict[str, torch.dtype], objects: list[ObjectItem],
                       produce: Callable[[TensorItem], torch.Tensor]):
    """A DCP save planner whose write items are ``tensors`` (as chunks of their keys) and ``objects``, each
    produced only when the writer asks for it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    _, meta, planner = _dcp()
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

    dcp, _, _ = _dcp()
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


def read_dcp_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise ValueError(f"{path}: not a readable torch.distributed.checkpoint (.metadata: {error})") from error


def merge_parts(iteration_dir: str, part_names: list[str], *, common: Optional[dict] = None) -> dict:
    """The checkpoint's own ``.metadata`` over every part (their files stay where they are), megatron's
    ``metadata.json`` and ``common.pt``. Refuses a key whose chunks do not tile its tensor exactly. Returns
    {key: global shape} of the tensors."""
    _, meta, _ = _dcp()
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




def iteration_dir_name(iteration: int) -> str:
    return "release" if iteration == RELEASE else f"iter_{iteration:07d}"


# ------------------------------------------------------------------------------------------------ reading
def find_iteration_dir(path: str) -> str:
    """``path`` itself when it holds a ``.metadata``; else the iteration directory its tracker file names."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    iteration = tracked_iteration(path)
    if iteration is None:
        raise FileNotFoundError(f"{path}: neither a torch_dist checkpoint (.metadata) nor a directory with "
                                f"{TRACKER_FILE}")
    found = os.path.join(path, iteration_dir_name(iteration))
    if not os.path.isfile(os.path.join(found, ".metadata")):
        raise FileNotFoundError(f"{path}'s tracker file names {iteration_dir_name(iteration)}, which holds no "
                                f".metadata")
    return found


def _overlap(a_offset, a_shape, b_offset, b_shape) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    start = tuple(max(x, y) for x, y in zip(a_offset, b_offset))
    stop = tuple(min(x + n, y + m) for x, n, y, m in zip(a_offset, a_shape, b_offset, b_shape))
    if any(s >= e for s, e in zip(start, stop)):
        return None
    return start, tuple(e - s for s, e in zip(start, stop))


class TorchDistReader:
    """Boxes of a torch_dist checkpoint's tensors, read chunk by chunk from their byte ranges."""

    def __init__(self, path: str):
        self.path = find_iteration_dir(path)
        self.metadata = read_dcp_metadata(self.path)
        _, meta, _ = _dcp()
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, meta.TensorStorageMetadata)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...], *,
             mapped: bool = False) -> torch.Tensor:
        """The box ``[offset, offset + shape)`` of ``key``, assembled from every stored chunk overlapping it. Where
        the box reaches past the stored tensor (a vocabulary padded for another TP size) it reads zeros.
        ``mapped``: a box that is one stored chunk may come back as a READ-ONLY view of the file's pages
        (:meth:`_map_chunk`), for a caller that only passes the bytes on; writing into it kills the process."""
        _, meta, _ = _dcp()
        stored = self.tensors.get(key)
        if stored is None:
            raise KeyError(f"{self.path}: no tensor {key!r} in the checkpoint")
        inside = _overlap(offset, shape, (0,) * len(shape), tuple(stored.size))
        if len(stored.size) != len(shape) or inside is None:
            raise ValueError(f"{self.path}: {key} is {tuple(stored.size)} in the checkpoint; cannot read "
                             f"{shape} at {offset} from it")
        index = self._chunk_index(key, offset, shape)
        if index is not None:  # the box is one stored chunk (a checkpoint read at the layout it was saved at)
            return self._load_chunk(index, mapped=mapped)
        out = torch.zeros(shape, dtype=stored.properties.dtype)
        filled = 0
        for chunk in stored.chunks:
            overlap = _overlap(offset, shape, tuple(chunk.offsets), tuple(chunk.sizes))
            if overlap is None:
                continue
            start, size = overlap
            data = self._load_chunk(meta.MetadataIndex(key, chunk.offsets), mapped=True)  # only copied from
            source = data[tuple(slice(s - o, s - o + n) for s, o, n in zip(start, chunk.offsets, size))]
            out[tuple(slice(s - o, s - o + n) for s, o, n in zip(start, offset, size))] = source
            filled += math.prod(size)
        if filled != math.prod(inside[1]):
            raise ValueError(f"{self.path}: {key} at {offset} {shape}: the stored chunks cover {filled} of "
                             f"{math.prod(inside[1])} elements")
        return out

    def chunk_in_file(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Optional[FileBytes]:
        """Where the box ``[offset, offset + shape)`` of ``key`` lies in its file, when it is one stored chunk
        held as a plain C-contiguous tensor (what DCP writes for a chunk); else ``None`` (then :meth:`read`)."""
        index = self._chunk_index(key, offset, shape)
        if index is None:
            return None
        path, start, length = self._item_range(index)
        found = self._stored_item(path, start, length)
        if found is None:
            return None
        storage_start, stored = found
        if stored.size != tuple(shape) or stored.stride != c_strides(stored.size):
            return None
        return FileBytes(path, storage_start + stored.storage_offset * stored.dtype.itemsize, stored.dtype,
                         stored.size)

    def _chunk_index(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]):
        """The stored chunk of ``key`` that is exactly the box ``[offset, offset + shape)``, if one is."""
        _, meta, _ = _dcp()
        for chunk in self.tensors[key].chunks:
            if tuple(chunk.offsets) == tuple(offset) and tuple(chunk.sizes) == tuple(shape):
                return meta.MetadataIndex(key, chunk.offsets)
        return None

    def _item_range(self, index) -> tuple[str, int, int]:
        """The file and byte range of a stored item, checked against the file's size."""
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{self.path}: {index.fqn} is stored with transforms {info.transform_descriptors}, "
                             f"which this reader does not undo")
        path = os.path.join(self.path, info.relative_path)
        if os.path.getsize(path) < info.offset + info.length:
            raise ValueError(f"{path}: truncated ({index.fqn} needs bytes {info.offset}..{info.offset + info.length})")
        return path, info.offset, info.length

    def _load_chunk(self, index, *, mapped: bool = False) -> torch.Tensor:
        path, start, length = self._item_range(index)
        if mapped:
            chunk = self._map_chunk(path, start, length)
            if chunk is not None:
                return chunk
        with _ByteRange(path, start, length) as item:
            return torch.load(item, map_location="cpu", weights_only=True)

    @classmethod
    def _map_chunk(cls, path: str, start: int, length: int) -> Optional[torch.Tensor]:
        """The item at ``[start, start + length)`` of ``path`` as a READ-ONLY view of its storage's bytes in the
        file (no read into fresh memory; a write of it copies from the page cache); ``None`` where it is not a
        plain tensor of a float dtype (then it is loaded)."""
        found = cls._stored_item(path, start, length)
        if found is None:
            return None
        storage_start, stored = found
        flat = map_bytes(path, storage_start, stored.storage_nbytes, stored.dtype)
        return torch.as_strided(flat, stored.size, stored.stride, stored.storage_offset)

    @staticmethod
    def _stored_item(path: str, start: int, length: int) -> Optional[tuple[int, _StoredTensor]]:
        """The item at ``[start, start + length)`` of ``path`` (DCP stores each one as ``torch.save`` of a
        tensor: a zip archive of a pickle and the storage's bytes, uncompressed): where in the file its storage's
        bytes start, and its view of them; ``None`` where the item is not a plain tensor of a float dtype."""
        with _ByteRange(path, start, length) as item:
            try:
                archive = torch._C.PyTorchFileReader(item)
                stored = _TensorPickle(io.BytesIO(archive.get_record("data.pkl"))).load()
                if not isinstance(stored, _StoredTensor) or (archive.has_record("byteorder")
                                                             and archive.get_record("byteorder") != b"little"):
                    return None
                record_start = archive.get_record_offset(stored.record)
            except (RuntimeError, pickle.UnpicklingError, ValueError, TypeError, EOFError):
                return None
        if record_start + stored.storage_nbytes > length:
            raise ValueError(f"{path}: the item at byte {start} holds {length} bytes, its tensor needs "
                             f"{record_start + stored.storage_nbytes}")
        return start + record_start, stored


# Storages a stored item may be mapped from (by the name ``torch.save`` pickles them under): the float dtypes
# checkpoints hold; an item of another kind is loaded with ``torch.load``.
_MAPPABLE_STORAGES = {"BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                      "FloatStorage": torch.float32, "DoubleStorage": torch.float64}


@dataclass(frozen=True)
class _StoredTensor:
    """A ``torch.save`` d tensor as its archive describes it: the record holding its storage, and its view."""
    record: str
    dtype: torch.dtype
    storage_numel: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def storage_nbytes(self) -> int:
        return self.storage_numel * self.dtype.itemsize


class _TensorPickle(pickle.Unpickler):
    """Reads the ``data.pkl`` of ``torch.save(tensor)`` into a :class:`_StoredTensor`, loading no bytes and
    building nothing but that: any other global (a parameter, a tensor subclass, a quantized tensor) is
    refused with ``UnpicklingError``."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _stored_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _MAPPABLE_STORAGES:
            return _MAPPABLE_STORAGES[name]  # the dtype stands for the storage class
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        _, dtype, key, _location, numel = pid
        return f"data/{key}", dtype, int(numel)


def _stored_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                   metadata=None) -> _StoredTensor:
    if not isinstance(storage, tuple) or backward_hooks or metadata:
        raise pickle.UnpicklingError("not a plain tensor")
    record, dtype, numel = storage
    return _StoredTensor(record, dtype, numel, tuple(size), tuple(stride), int(storage_offset))


class _ByteRange(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file as a file of their own, read with ``pread`` : ``torch.load``
    reads a stored item's tensor straight into the tensor's memory (``readinto``), with no copy of the item's
    bytes in between."""

    def __init__(self, path: str, start: int, length: int):
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._path, self._start, self._length, self._position = path, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._length - self._position)
        done = 0
        while done < wanted:  # pread may return short counts for large requests
            got = os.preadv(self._fd, [view[done:wanted]], self._start + self._position + done)
            if got <= 0:
                raise ValueError(f"{self._path}: unexpected end of file at byte {self._start + self._position + done}")
            done += got
        self._position += done
        return done

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()
