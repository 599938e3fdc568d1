"""Out of host memory, said as such: the phase, the rank, the node's numbers, and what holds host memory.

A worker that outgrows the node's RAM is killed: by Ray's memory monitor (the default, at 95% of the node's
memory), whose ``ray.exceptions.OutOfMemoryError`` resolves the worker's pending call, or by the kernel. Ray's
text names the node's numbers but not the step's phase nor what in a megarl run lives on the host: the host share
of an offloaded optimizer, the trainer's weights parked while vLLM generates, the checkpoint being written. The
worker group turns the monitor's error into :class:`HostOutOfMemory`; per-phase host peaks are logged as
``memory/<phase>/host_peak_gb`` and the plan (``python -m megarl.plan``) counts the host side before a run.
Leaves out: a kill by the kernel's OOM killer, which Ray reports as an ordinary worker death.
"""

from __future__ import annotations

from typing import Optional

import ray

from megarl.controller.device_oom import PHASES

HOST_KNOBS = (
    "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction (lower: less of Adam's "
    "state and master weights on the host, more on the GPU)",
    "actor_rollout_ref.actor.megatron.{param,grad,optimizer}_offload=false (the trainer's share stays on the GPU "
    "while vLLM generates instead of being parked on the host)",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size, or more nodes "
    "(each GPU's worker keeps its share on its own node's host)",
    "python -m megarl.plan --config ... --host-memory-gib <node GiB> (the plan's host figure, part by part)",
)


class HostOutOfMemory(RuntimeError):
    """A worker was killed for the node's memory in a phase; the message names the phase, rank and knobs."""

    def __init__(self, message: str, *, phase: str, rank: Optional[int]):
        super().__init__(message)
        self.phase, self.rank = phase, rank

    @classmethod
    def from_ray(cls, error: BaseException, phase: str, rank: Optional[int]) -> "HostOutOfMemory":
        description = PHASES.get(phase, (phase,))[0]
        lines = str(error).strip().splitlines()
        monitor = lines[0][:400] if lines else type(error).__name__  # "... Memory on the node (IP: ...) was ..."
        where = f"rank {rank}" if rank is not None else "a worker"
        knob_lines = "".join(f"\n  - {knob}" for knob in HOST_KNOBS)
        message = (f"out of host memory in {description} [{phase}] on {where}: Ray's memory monitor killed the "
                   f"worker ({monitor}). To hold less on the host:{knob_lines}")
        return cls(message, phase=phase, rank=rank)

    def __reduce__(self):
        return (_rebuild, (str(self), self.phase, self.rank))


def _rebuild(message: str, phase: str, rank: Optional[int]) -> HostOutOfMemory:
    return HostOutOfMemory(message, phase=phase, rank=rank)


def is_host_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, ray.exceptions.OutOfMemoryError)
