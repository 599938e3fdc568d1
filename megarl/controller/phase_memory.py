"""Peak GPU memory per phase of a step (generation, log-probs, update, weight sync), as metrics.

``memory/<phase>/peak_gb`` is the device-wide peak of the phase: what the device had in use when the phase
began plus the most PyTorch's caching allocator grew its reserved memory above its level at that moment (tensors
the phase takes from blocks the allocator already holds are in the device's count already: counting the growth of
allocated memory instead read 88 GB on an 85.9 GB card). The device-wide count
(every allocator and process) is the base because PyTorch's own counters cannot be: vLLM's sleep-mode pool
hands out tensors that stay "allocated" while asleep (their pages are unmapped), so an allocator peak would
count a sleeping KV cache as used. ``memory/<phase>/device_used_gb`` is the device-wide use when the phase
ended. On CPU nothing is recorded. Leaves out: host memory, other processes' growth during a phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_GB = 1e9


class PhaseMemory:
    def __init__(self, device: str):
        self.enabled = device == "cuda" and torch.cuda.is_available()
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def track(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        torch.cuda.reset_peak_memory_stats()
        reserved_at_start = torch.cuda.memory_reserved()
        used_at_start = _device_used()
        try:
            yield
        finally:
            used_at_end = _device_used()
            growth = max(0, torch.cuda.max_memory_reserved() - reserved_at_start)
            self.peaks[f"memory/{phase}/peak_gb"] = max(used_at_start + growth, used_at_end) / _GB
            self.peaks[f"memory/{phase}/device_used_gb"] = used_at_end / _GB

    def as_metrics(self) -> dict[str, float]:
        """What was recorded since the last call (then forgotten: one step's phases at a time)."""
        metrics, self.peaks = self.peaks, {}
        return metrics


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free
