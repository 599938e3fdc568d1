"""GPU worker groups: NCCL world over Ray-assigned GPUs, and two groups colocated on one GPU per bundle.

Uses min(2, visible GPUs) ranks and skips without CUDA. Checks what CPU tests cannot: Ray's CUDA_VISIBLE_DEVICES
narrowing, the local device index handed to workers, NCCL init through `init_torch_distributed`, and fractional GPU colocation;
and that a GPU worker's torch runs its CPU work on its share of the node's cores, not the one thread Ray's
OMP_NUM_THREADS=1 would leave it (the host Adam of the 7B run: 9.1 s a step on one core, 2026-12-07).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("ray", reason="Ray is not installed on this machine")

from megarl.controller.resource_pool import ResourcePool
from megarl.controller.worker_env import init_torch_distributed
from megarl.controller.worker_group import WorkerGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("ray_cluster"),  # the session's (tests/conftest.py), holding every visible GPU
]

RANKS = min(2, torch.cuda.device_count())


class NcclWorker:
    def __init__(self) -> None:
        self.ctx = init_torch_distributed(timeout_s=120)

    def all_reduce_rank(self) -> dict:
        value = torch.tensor([float(dist.get_rank() + 1)], device="cuda")
        dist.all_reduce(value)
        return {"sum": value.item(), "device": torch.cuda.current_device(),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "uuid": str(torch.cuda.get_device_properties(0).uuid),
                "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                "cores": len(os.sched_getaffinity(0)), "local_world_size": self.ctx.local_world_size}


def test_nccl_world_and_colocated_groups_share_each_gpu():
    pool = ResourcePool("gpu", nodes=[RANKS], device="cuda", cpus_per_process=1, gpus_per_process=1)
    try:
        first = WorkerGroup(pool, NcclWorker, name_prefix="train", bundle_share=0.5)
        second = WorkerGroup(pool, NcclWorker, name_prefix="rollout", bundle_share=0.5)
        a, b = first.call("all_reduce_rank"), second.call("all_reduce_rank")
        expected = RANKS * (RANKS + 1) / 2
        assert [r["sum"] for r in a + b] == [expected] * (2 * RANKS)
        assert [r["device"] for r in a] == [int(info["local_device"]) for info in first.worker_infos]
        assert all(r["visible"] and len(r["visible"].split(",")) == 1 for r in a)  # Ray narrowed visibility
        assert len({r["uuid"] for r in a}) == RANKS  # the ranks drive different GPUs ...
        assert [r["uuid"] for r in a] == [r["uuid"] for r in b]  # ... and colocated rank r shares rank r's GPU
        if not os.environ.get("OMP_NUM_THREADS"):  # the driver set none: Ray's 1 is replaced by the worker's share
            assert all(r["threads"] == max(1, r["cores"] // r["local_world_size"]) for r in a + b), a + b
            assert any(r["threads"] > 1 for r in a) or os.cpu_count() < 2 * RANKS
        print(first.format_placement_table())
        first.shutdown()
        second.shutdown()
    finally:
        pool.release()
