"""The per-rank environment a WorkerGroup gives each worker process, and torch.distributed init from it.

`WorkerGroup` writes these variables into the worker process before the worker class is constructed:
MASTER_ADDR / MASTER_PORT (rank 0's node and a free port there), RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE (position among the group's ranks on the same physical node), MEGARL_DEVICE ("cuda" or "cpu"),
MEGARL_LOCAL_DEVICE (the CUDA device index to use inside this process: Ray narrows CUDA_VISIBLE_DEVICES to the
GPU of the bundle, so this is usually 0), MEGARL_GROUP_NAME and MEGARL_POOL_NODE (index of the pool node).
This module only reads them; it has no Ray import so worker classes and engines can use it.

Threads: Ray starts every actor with OMP_NUM_THREADS set to its CPU share (1 for megarl's workers), so torch in a
GPU worker would run its CPU work on one core: megatron's host Adam (HybridDeviceOptimizer), the offload copies.
:func:`intra_op_threads` gives a GPU worker its share of the node's cores instead; a CPU worker keeps one (the
ranks are the parallelism there), and OMP_NUM_THREADS in the driver's environment wins on either.
Leaves out: Megatron parallel-state (TP/PP/CP/DP) initialisation, which belongs to the engines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

ENV_GROUP_NAME = "MEGARL_GROUP_NAME"
ENV_DEVICE = "MEGARL_DEVICE"
ENV_LOCAL_DEVICE = "MEGARL_LOCAL_DEVICE"
ENV_POOL_NODE = "MEGARL_POOL_NODE"
ENV_THREADS = "MEGARL_WORKER_THREADS"  # the driver's OMP_NUM_THREADS, which Ray's own setting would hide


@dataclass(frozen=True)
class WorkerContext:
    group_name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pool_node: int
    master_addr: str
    master_port: int
    device: str  # "cuda" or "cpu"
    local_device_index: int | None  # CUDA device index inside this process; None on CPU


def read_worker_context(environ: Mapping[str, str] | None = None) -> WorkerContext:
    """Read the WorkerGroup-provided variables; raises naming the missing one outside a worker group."""
    env = os.environ if environ is None else environ

    def need(name: str) -> str:
        if name not in env:
            raise RuntimeError(f"environment variable {name} is not set: this process was not started by a "
                               "megarl WorkerGroup (or the variable was removed)")
        return env[name]

    device = need(ENV_DEVICE)
    local_device = env.get(ENV_LOCAL_DEVICE, "")
    return WorkerContext(
        group_name=need(ENV_GROUP_NAME),
        rank=int(need("RANK")),
        world_size=int(need("WORLD_SIZE")),
        local_rank=int(need("LOCAL_RANK")),
        local_world_size=int(need("LOCAL_WORLD_SIZE")),
        pool_node=int(need(ENV_POOL_NODE)),
        master_addr=need("MASTER_ADDR"),
        master_port=int(need("MASTER_PORT")),
        device=device,
        local_device_index=int(local_device) if local_device != "" else None,
    )


def init_torch_distributed(*, backend: str | None = None, timeout_s: float = 600.0) -> WorkerContext:
    """Join the group's torch.distributed world (gloo on CPU, nccl on CUDA) and select this rank's GPU.

    `timeout_s` is the collective timeout of the default process group: it is what turns a collective whose
    peer hangs (alive but never arriving) into an exception on the waiting ranks. On NCCL it is enforced by
    the watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default). The driver's per-call timeout in
    `WorkerGroup.call` is the outer guard.
    """
    from megarl.engines.megatron.parallel import init_distributed

    ctx = read_worker_context()
    torch.set_num_threads(intra_op_threads(ctx.device, ctx.local_world_size, len(os.sched_getaffinity(0)),
                                           os.environ.get(ENV_THREADS)))
    if dist.is_initialized():
        raise RuntimeError(f"{ctx.group_name} rank {ctx.rank}: torch.distributed is already initialised")
    if ctx.device == "cuda" and ctx.local_device_index is None:
        raise RuntimeError(f"{ctx.group_name} rank {ctx.rank}: {ENV_LOCAL_DEVICE} is not set on a CUDA worker")
    init_distributed(backend=backend, timeout_s=timeout_s, device=ctx.device,
                     local_device_index=ctx.local_device_index)
    return ctx


def intra_op_threads(device: str, local_world_size: int, cores: int, requested: str | None = None) -> int:
    """torch's intra-op threads for one worker process: ``requested`` (the driver's OMP_NUM_THREADS) if given; on
    a GPU node the ``cores`` this process may run on shared among the group's ``local_world_size`` processes there
    (phases of colocated groups take turns, so they do not add up); on CPU 1."""
    if requested:
        return max(1, int(requested))
    if device != "cuda":
        return 1
    return max(1, cores // max(1, local_world_size))


def worker_env_for(device: str) -> dict[str, str]:
    """Environment every worker needs on ``device`` (threads: CPU workers must not oversubscribe the cores),
    and the driver's fault-injection point (:mod:`megarl.controller.fault_injection`), which would otherwise
    reach only the workers of a cluster started after it was set."""
    from megarl.controller.fault_injection import ENV as KILL_AT

    from megarl.engines.megatron.expected_warnings import python_warnings_env

    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": python_warnings_env(os.environ.get("PYTHONWARNINGS"))}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    if os.environ.get("OMP_NUM_THREADS"):
        env[ENV_THREADS] = os.environ["OMP_NUM_THREADS"]
    if os.environ.get(KILL_AT):
        env[KILL_AT] = os.environ[KILL_AT]
    return env
