"""Reading any ``torch_dist`` checkpoint (converted, or saved by megarl's or Megatron-LM's training at any
layout) one box at a time (:class:`TorchDistReader`): a box of a key is assembled from the stored chunks that
overlap it, each read from its byte range in its file (``torch.load`` of one item, as DCP's reader does), or,
for a caller that only passes the bytes on, mapped or located (the tensor's bytes in the file, where the item
is a plain tensor: :meth:`TorchDistReader.chunk_in_file`).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.checkpoint_io.safetensors_stream import FileBytes, c_strides, map_bytes
from megarl.checkpoint_io.torch_dist_layout import find_iteration_dir


def dcp_modules():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as meta
    from torch.distributed.checkpoint import planner

    return dcp, meta, planner


def read_dcp_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise ValueError(f"{path}: not a readable torch.distributed.checkpoint (.metadata: {error})") from error


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
        _, meta, _ = dcp_modules()
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
        _, meta, _ = dcp_modules()
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
        _, meta, _ = dcp_modules()
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
