"""Move an engine's parameters, DDP gradient buffers and optimizer states off the device and back.

Used when training shares GPUs with rollout: offload before generation, reload before the update.
Every distinct tensor storage (DDP ``param_data``/``grad_data`` buffers, parameters outside them, optimizer
state such as Adam moments and fp32 main params) is copied into a host backup (pinned memory on CUDA) and
the device storage is resized to 0 bytes. Reload re-grows each storage and copies the bytes back, so all
views (``param.main_grad``, params inside DDP buffers, optimizer references) stay valid and training
continues bit-identically. On CPU this is a real move too: the backup is a separate host buffer and the
original storage is released, which is what the CPU test checks.

Two kinds of storage are not copied. Gradient buffers are dropped, not saved: every update zeroes them before
its first backward, so they come back zeroed and cost no host memory or copy time (at 7B a fp32 grad buffer is
30 GB). And on a GPU machine, optimizer state already on the host (megatron's ``optimizer_cpu_offload``: the
CPU part of its HybridDeviceOptimizer) stays where it is. Leaves out: partial offload policies beyond the three
flags, and overlapping the copies with compute.

On CUDA the saved copies of one engine share one page-locked host buffer of exactly their size (pageable memory
registered with CUDA, as torch's checkpoint stager pins), kept for the engine's next offload. PyTorch's pinned
allocator would round every copy up to a power of two and keep the block cached: a 7B LoRA base's 15.2 GB of
frozen weights, one storage per tensor, held 28.7 GB of host memory that way (the 7B LoRA run of 2026-12-07
resided at 33.3 GB; docs/benchmarks.md), and a 32B base would not fit a 125 GB host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

_ALIGNMENT = 4096  # each copy starts on a page of the shared buffer


@dataclass
class _Offloaded:
    storage: torch.UntypedStorage
    backup: Optional[torch.Tensor]  # uint8 host copy of the whole storage; None: dropped, comes back zeroed
    device: torch.device
    nbytes: int


@dataclass
class OffloadState:
    entries: list[_Offloaded] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        """Device bytes released."""
        return sum(e.nbytes for e in self.entries)

    @property
    def host_bytes(self) -> int:
        """Host bytes the saved copies take."""
        return sum(e.backup.numel() for e in self.entries if e.backup is not None)


class PinnedHostBuffer:
    """``nbytes`` of pageable host memory, page-locked with ``cudaHostRegister`` so copies to and from the
    device run asynchronously, and unregistered before the memory is freed."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._registered = False
        if nbytes:
            error = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if error:
                raise RuntimeError(
                    f"offload: page-locking {nbytes / 2**30:.2f} GiB of host memory for an engine's offloaded state "
                    f"failed (cudaHostRegister: CUDA error {error}); the megatron.param_offload / optimizer_offload "
                    f"knobs decide what goes there, and `python -m megarl.plan --host-memory-gib N` counts it")
            self._registered = True

    def release(self) -> None:
        if self._registered:
            self._registered = False
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the process frees it anyway
            pass


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _engine_host_buffer(engine, nbytes: int) -> PinnedHostBuffer:
    """The engine's buffer, kept on the engine (it lives and dies with it) and reused by its next offload of the
    same bytes: every step offloads the same storages, and registering pins every page again. Replacing it
    never loses a copy: an earlier state's copies are views that keep its memory (then pageable) alive."""
    buffer = getattr(engine, "_offload_host_buffer", None)
    if buffer is None or buffer.nbytes != nbytes:
        if buffer is not None:
            buffer.release()  # before the new one, so the two never both hold host memory
        buffer = PinnedHostBuffer(nbytes)
        engine._offload_host_buffer = buffer
    return buffer


def _optimizer_tensors(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _model_tensors(engine, *, params: bool, grads: bool):
    for chunk in engine.model:
        # Megatron DDP keeps its param/grad buffers in list attributes; a bare (frozen) GPTModel has none, and
        # its ``buffers`` is nn.Module's method.
        ddp_buffers = [b for name in ("buffers", "expert_parallel_buffers")
                       if isinstance(getattr(chunk, name, None), list) for b in getattr(chunk, name)]
        for buffer in ddp_buffers:
            if params and buffer.param_data is not None:
                yield buffer.param_data
            if grads and buffer.grad_data is not None:
                yield buffer.grad_data
        if params:
            yield from chunk.parameters()
        if grads:
            yield from (p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None)


def _byte_view(storage: torch.UntypedStorage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def offload_engine(engine, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> OffloadState:
    """Free the chosen device storages of ``engine``; returns what :func:`reload_engine` needs."""
    saved = list(_model_tensors(engine, params=params, grads=False))
    if optimizer and engine.optimizer is not None:
        saved += list(_optimizer_tensors(engine.optimizer))
    dropped = list(_model_tensors(engine, params=False, grads=True)) if grads else []
    pin = torch.cuda.is_available()
    chosen: list[tuple[torch.UntypedStorage, torch.device, bool]] = []
    seen = set()
    for tensor, keep in [(t, True) for t in saved] + [(t, False) for t in dropped]:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen or (pin and tensor.device.type == "cpu"):
            continue  # empty, seen, or (on a GPU machine) already on the host
        seen.add(key)
        chosen.append((storage, tensor.device, keep))
    host = None
    kept_bytes = sum(_aligned(s.nbytes()) for s, _, keep in chosen if keep)
    if pin and kept_bytes:
        host = _engine_host_buffer(engine, kept_bytes).tensor
    state = OffloadState()
    offset = 0
    for storage, device, keep in chosen:
        backup = None
        if keep:
            if host is None:  # CPU: a separate host buffer per storage (the move the CPU test checks)
                backup = torch.empty(storage.nbytes(), dtype=torch.uint8)
            else:
                backup = host[offset:offset + storage.nbytes()]
                offset += _aligned(storage.nbytes())
            backup.copy_(_byte_view(storage, device), non_blocking=pin)
        state.entries.append(_Offloaded(storage=storage, backup=backup, device=device, nbytes=storage.nbytes()))
    if pin:
        torch.cuda.synchronize()
    for entry in state.entries:
        entry.storage.resize_(0)
    if pin:
        torch.cuda.empty_cache()
    return state


def reload_engine(state: OffloadState) -> None:
    """Re-allocate every offloaded storage on its device and copy its bytes back."""
    for entry in state.entries:
        entry.storage.resize_(entry.nbytes)
        if entry.backup is None:
            _byte_view(entry.storage, entry.device).zero_()
        else:
            _byte_view(entry.storage, entry.device).copy_(entry.backup, non_blocking=entry.device.type == "cuda")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    state.entries.clear()

