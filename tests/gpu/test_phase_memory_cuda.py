"""On a GPU: ``memory/<phase>/peak_gb`` counts what the device really held. A phase served from blocks PyTorch's
allocator already caches adds nothing to the device's use (the old count added the tensors' size again: 88 GB on
an 85.9 GB card); a phase that makes the allocator reserve more adds exactly that."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(120)]

GIB = 2**30
SLACK = 64 * 2**20  # the device's count moves in 2 MiB pages; nothing else allocates during the test


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_cached_blocks_count_once_and_new_reservations_count_as_they_grow():
    from megarl.controller.phase_memory import PhaseMemory

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cached = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    del cached  # 2 GiB stay reserved by the allocator, free for its next tensors
    used_before = _device_used()
    memory = PhaseMemory("cuda")
    with memory.track("reuse"):
        reused = torch.empty(GIB, dtype=torch.uint8, device="cuda")  # carved from the cached block
        del reused
    with memory.track("grow"):
        grown = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")  # no cached block is large enough
        del grown
    metrics = memory.as_metrics()
    total = torch.cuda.mem_get_info()[1]
    assert abs(metrics["memory/reuse/peak_gb"] * 1e9 - used_before) < SLACK, (metrics, used_before)
    assert abs(metrics["memory/grow/peak_gb"] * 1e9 - (used_before + 3 * GIB)) < SLACK, (metrics, used_before)
    assert all(value * 1e9 <= total for value in metrics.values()), (metrics, total)
    torch.cuda.empty_cache()
