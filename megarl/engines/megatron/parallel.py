"""Bring up torch.distributed and megatron's parallel state for one worker process.

The worker already has RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment (set by the
controller, or by the multi-process test harness). This module picks the backend (nccl on GPU, gloo on
CPU, where it also enables :mod:`megarl.models.cpu_compat`), creates megatron's TP/PP/CP/EP/DP
groups and seeds the model-parallel RNG. It does not build models.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits; the controller uses it to dispatch and collect."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    ep_rank: int

    @property
    def is_collect_rank(self) -> bool:
        """One rank per data-parallel replica holds the results: TP rank 0, CP rank 0, last PP stage."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1


def device_for_this_process() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_bound_store: Optional[dist.TCPStore] = None  # rank 0's rendezvous store, bound before the group forms


def bind_rendezvous_store(timeout_s: float = 600.0) -> int:
    """On the process that will be rank 0, before the group forms: start the group's rendezvous store on a port
    the system picks as it binds, and return that port (the group's MASTER_PORT). A port chosen first and bound
    later by ``init_process_group`` can be taken in between by another process; this one is held from here on,
    and :func:`init_distributed` forms the group on this store."""
    global _bound_store
    _bound_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s))
    return int(_bound_store.port)


def init_distributed(*, backend: Optional[str] = None, timeout_s: float = 600.0, device: Optional[str] = None,
                     local_device_index: Optional[int] = None) -> None:
    """Initialise the default process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT): the
    one place megarl does, on a TCP store every rank of the group makes here; idempotent. ``device``: "cuda"
    or "cpu" (default: CUDA when available); ``local_device_index``: this rank's GPU (default: LOCAL_RANK).

    On CPU the megatron CPU redirections are enabled even when the process group already exists.
    """
    use_cuda = device == "cuda" if device is not None else torch.cuda.is_available()
    if not use_cuda:
        from megarl.models.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
    if dist.is_initialized():
        return
    if use_cuda:
        index = local_device_index
        if index is None:
            index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
    global _bound_store
    rank, world_size, timeout = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timedelta(seconds=timeout_s)
    # Every rank makes its store here, the same way (rank 0 the server, unless bound already), so that rank 0
    # can hold its port from the moment it was chosen (bind_rendezvous_store).
    if _bound_store is not None and rank == 0 and _bound_store.port == int(os.environ["MASTER_PORT"]):
        store, _bound_store = _bound_store, None  # one group per store
        store.set_timeout(timeout)
    else:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend=backend or ("nccl" if use_cuda else "gloo"), store=store, rank=rank,
                            world_size=world_size, timeout=timeout)


def initialize_megatron_parallel(*, layout: ParallelLayout, seed: int = 1234) -> RankInfo:
    """Create megatron's process groups for ``layout`` over the current world and seed the RNGs."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    init_distributed()
    layout.data_parallel(dist.get_world_size())
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_parallel,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_rank_info()


def current_rank_info() -> RankInfo:
    from megatron.core import parallel_state as mpu

    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
    )


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
