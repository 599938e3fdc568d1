"""Run as a script by test_host_oom.py: its own Ray cluster whose memory monitor fires ~1.5 GiB above the node's
use at start, a 2-rank gloo group, and rank 1 eating host memory in ``update_actor`` while rank 0 waits in a
collective. Prints the WorkerError's fields as JSON."""

import json
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist

from megarl.controller.worker_env import init_torch_distributed

MIB = 2**20


class EatingWorker:
    def __init__(self) -> None:
        self.ctx = init_torch_distributed(timeout_s=60)

    def update_actor(self, victim: int, gib: float) -> int:
        if dist.get_rank() == victim:
            eaten = []
            for _ in range(int(gib * 1024 / 128)):
                eaten.append(bytearray(128 * MIB))  # written (zeroed) pages: resident
                time.sleep(0.02)
            time.sleep(30)  # the monitor kills the worker before this ends
        value = torch.ones(1)
        dist.all_reduce(value)
        return dist.get_rank()

    def pid(self) -> int:
        return os.getpid()


def main() -> None:
    from megarl.controller.ray_cluster import init_ray, shutdown_ray
    from megarl.controller.resource_pool import ResourcePool
    from megarl.controller.worker_group import WorkerError, WorkerGroup

    repo = sys.argv[1]
    memory = psutil.virtual_memory()
    threshold = (memory.total - memory.available + 1.5 * 2**30) / memory.total
    init_ray(None, num_cpus=2, extra_pythonpath=[repo], include_dashboard=False,
             _system_config={"memory_usage_threshold": threshold, "memory_monitor_refresh_ms": 100})
    pool = ResourcePool("eat", nodes=[2], device="cpu", cpus_per_process=1)
    group = WorkerGroup(pool, EatingWorker, name_prefix="eat")
    result: dict = {}
    try:
        group.call("update_actor", 1, 4.0)
        result["error"] = None
    except WorkerError as err:
        result.update(error=str(err), rank=err.rank, method=err.method, cause=type(err.cause).__name__,
                      cause_phase=getattr(err.cause, "phase", None))
    try:
        group.call("pid")
        result["after"] = "usable"
    except RuntimeError as err:
        result["after"] = str(err)
    print("RESULT " + json.dumps(result), flush=True)
    group.shutdown()
    pool.release()
    shutdown_ray()


if __name__ == "__main__":
    main()
