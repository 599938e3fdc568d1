"""Out of device memory, said as such: the phase, the rank, what was asked for and what was free, and the knobs
that make the phase smaller.

Running out of GPU memory shows up in many forms: PyTorch's ``torch.OutOfMemoryError`` from the caching
allocator, an NCCL error from a collective whose own buffer could not be allocated ("Failed to CUDA calloc
async 608 bytes" from the grad-norm all-reduce), a cuBLAS workspace that failed, a raw CUDA error. A user who
sees the NCCL one looks for a network fault. Every worker call runs under :func:`naming_out_of_memory` (the
Ray worker host and the in-process group both do), which turns any of these into :class:`DeviceOutOfMemory`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Optional

_OOM_SIGNS = re.compile(
    r"out of memory|Failed to CUDA (?:m|c)alloc|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED"
    r"|CUDNN_STATUS_ALLOC_FAILED|cudaMalloc(?:Async)? failed", re.IGNORECASE)
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_REQUESTED = (re.compile(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)"),
              re.compile(r"(?:calloc|malloc|alloc)(?: async)? (\d+) (bytes)", re.IGNORECASE))

# The worker methods (and the worker's construction) are the phases of a step; what shrinks each one.
_PACKING = "actor_rollout_ref.model.use_sequence_packing=true"
_TRAINER_OFF_DEVICE = ("actor_rollout_ref.actor.megatron.{param,grad,optimizer}_offload=true (the trainer's "
                       "share leaves the GPU while vLLM generates)")
_GENERATION_KNOBS = ("actor_rollout_ref.rollout.gpu_memory_utilization (vLLM's share of the GPU: weights + KV "
                     "cache)", "actor_rollout_ref.rollout.free_cache_engine=true", _TRAINER_OFF_DEVICE)
_UPDATE_KNOBS = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu (token budget of a micro-batch, with "
                 f"{_PACKING})", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                 "actor_rollout_ref.actor.megatron.recompute_granularity=full (activation recompute)",
                 "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true (Adam's "
                 "state and master weights on the host)",
                 "actor_rollout_ref.rollout.free_cache_engine=true (vLLM asleep while Megatron trains)")
PHASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "construct": ("start-up (models, optimizer and rollout engine built on the device)",
                  ("actor_rollout_ref.actor.megatron.params_dtype=bfloat16",
                   "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true",
                   "actor_rollout_ref.rollout.gpu_memory_utilization",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size "
                   "(more GPUs per model)")),
    "generate": ("generation (with the rollout engine's wake-up)", _GENERATION_KNOBS),
    "sync_weights": ("weight sync (the rollout engine's weights woken up, Megatron shards gathered into HF buckets "
                     "for it)",
                     ("actor_rollout_ref.rollout.weight_sync_bucket_mb (one bucket's size on the device)",
                      "actor_rollout_ref.rollout.gpu_memory_utilization")),
    "compute_log_probs": ("old log-probs (the trainer's return to the device after generation, then the actor's "
                          "forward pass)",
                          ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (token budget, with "
                           f"{_PACKING})", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                           "actor_rollout_ref.rollout.free_cache_engine=true (vLLM's KV cache and weights freed "
                           "while Megatron trains)")),
    "compute_ref_log_probs": ("reference log-probs",
                              ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                               "actor_rollout_ref.ref.param_offload=true")),
    "update_actor": ("actor update (forward, backward, optimizer step)", _UPDATE_KNOBS),
    "compute_values": ("critic values", ("critic.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu")),
    "update_critic": ("critic update", ("critic.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                                        "critic.megatron.recompute_granularity=full")),
    "save_checkpoint": ("checkpoint save", ("actor_rollout_ref.actor.megatron.optimizer_offload=true",)),
    "load_checkpoint": ("checkpoint load", ("actor_rollout_ref.actor.megatron.optimizer_offload=true",)),
}


class DeviceOutOfMemory(RuntimeError):
    """A phase ran out of device memory; the message names the phase, rank, numbers and knobs."""

    def __init__(self, message: str, *, phase: str, rank: Optional[int], requested_bytes: Optional[float],
                 free_bytes: Optional[int], total_bytes: Optional[int], knobs: tuple[str, ...]):
        super().__init__(message)
        self.phase, self.rank, self.knobs = phase, rank, knobs
        self.requested_bytes, self.free_bytes, self.total_bytes = requested_bytes, free_bytes, total_bytes

    @classmethod
    def from_error(cls, error: BaseException, phase: str, rank: Optional[int]) -> "DeviceOutOfMemory":
        free, total, reserved = _device_numbers()
        requested = requested_bytes(str(error))
        description, knobs = PHASES.get(phase, (phase, ()))
        numbers = ", ".join(part for part in (
            f"requested {_size(requested)}" if requested is not None else None,
            f"free {_size(free)} of {_size(total)}" if free is not None else None,
            f"held by this process's PyTorch allocator {_size(reserved)}" if reserved is not None else None,
        ) if part)
        where = f"rank {rank}" if rank is not None else "this process"
        knob_lines = "".join(f"\n  - {knob}" for knob in knobs) or "\n  - (none known for this phase)"
        lines = str(error).strip().splitlines()
        raised = lines[0][:300] if lines else type(error).__name__
        message = (f"out of device memory in {description} [{phase}] on {where}{': ' + numbers if numbers else ''}."
                   f" To make this phase smaller:{knob_lines}\n(as raised: {raised})")
        return cls(message, phase=phase, rank=rank, requested_bytes=requested, free_bytes=free, total_bytes=total,
                   knobs=knobs)

    def __reduce__(self):  # crosses Ray and multiprocessing as itself, message and fields intact
        return (_rebuild, (str(self), self.phase, self.rank, self.requested_bytes, self.free_bytes,
                           self.total_bytes, self.knobs))


def _rebuild(message, phase, rank, requested, free, total, knobs) -> DeviceOutOfMemory:
    return DeviceOutOfMemory(message, phase=phase, rank=rank, requested_bytes=requested, free_bytes=free,
                             total_bytes=total, knobs=knobs)


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, DeviceOutOfMemory):
        return False  # already said
    return isinstance(error, torch.OutOfMemoryError) or bool(_OOM_SIGNS.search(str(error)))


def requested_bytes(message: str) -> Optional[float]:
    for pattern in _REQUESTED:
        found = pattern.search(message)
        if found:
            return float(found.group(1)) * _UNITS.get(found.group(2), 1)
    return None


def _size(value: Optional[float]) -> str:
    if value is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} bytes"


def _device_numbers() -> tuple[Optional[int], Optional[int], Optional[int]]:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None, None
    try:
        free, total = torch.cuda.mem_get_info()
        return free, total, torch.cuda.memory_reserved()
    except Exception:  # a device too broken to answer: the message goes without the numbers
        return None, None, None


@contextlib.contextmanager
def naming_out_of_memory(phase: str, rank: Optional[int] = None) -> Iterator[None]:
    """Run a phase; out of device memory in it becomes :class:`DeviceOutOfMemory` (chained to the original)."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        raise DeviceOutOfMemory.from_error(error, phase, rank) from error
