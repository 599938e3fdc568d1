"""Peak GPU memory per phase of a step (generation, log-probs, update, weight sync), as metrics.

``memory/<phase>/peak_gb`` is the device-wide peak of the phase: what the device had in use when the phase
began plus the most PyTorch's caching allocator grew its reserved memory above its level at that moment (tensors
the phase takes from blocks the allocator already holds are in the device's count already: counting the growth of
allocated memory instead read 88 GB on an 85.9 GB card). The device-wide count
(every allocator and process) is the base because PyTorch's own counters cannot be: vLLM's sleep-mode pool
hands out tensors that stay "allocated" while asleep (their pages are unmapped), so an allocator peak would
count a sleeping KV cache as used. ``memory/<phase>/device_used_gb`` is the device-wide use when the phase
ended. On CPU no device figure is recorded.

``memory/<phase>/host_peak_gb`` is the most host memory this worker process held resident during the phase
(Linux's VmHWM, reset at the phase's start through /proc/self/clear_refs): the host share of an offloaded
optimizer, parked weights and pinned buffers, plus the process itself (Python, torch, the CUDA context, an
in-process rollout engine). Recorded on any device where Linux offers the reset. Phases do not nest (each
resets the process's high-water mark). Leaves out: other processes, on the device or the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megarl.checkpoint_io.memory import peak_rss_bytes, reset_peak_rss

_GB = 1e9


class PhaseMemory:
    def __init__(self, device: str):
        self.device_enabled = device == "cuda" and torch.cuda.is_available()
        self.host_enabled = _host_peak_resettable()
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def track(self, phase: str) -> Iterator[None]:
        if self.host_enabled:
            reset_peak_rss()
        if self.device_enabled:
            torch.cuda.reset_peak_memory_stats()
            reserved_at_start = torch.cuda.memory_reserved()
            used_at_start = _device_used()
        try:
            yield
        finally:
            if self.device_enabled:
                used_at_end = _device_used()
                growth = max(0, torch.cuda.max_memory_reserved() - reserved_at_start)
                self.peaks[f"memory/{phase}/peak_gb"] = max(used_at_start + growth, used_at_end) / _GB
                self.peaks[f"memory/{phase}/device_used_gb"] = used_at_end / _GB
            if self.host_enabled:
                self.peaks[f"memory/{phase}/host_peak_gb"] = peak_rss_bytes() / _GB

    def as_metrics(self) -> dict[str, float]:
        """What was recorded since the last call (then forgotten: one step's phases at a time)."""
        metrics, self.peaks = self.peaks, {}
        return metrics


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _host_peak_resettable() -> bool:
    try:
        reset_peak_rss()
        peak_rss_bytes()
    except (OSError, RuntimeError):  # not Linux, or /proc without the peak-RSS reset (kernels before 4.0)
        return False
    return True
