"""Peak GPU memory per phase of a step (generation, log-probs, update, weight sync), as metrics.

Two numbers per phase, because the hybrid engine's memory lives in two places: ``max_allocated_gb`` is the
peak of PyTorch's caching allocator during the phase (Megatron's params, grads, optimizer states and
activations; vLLM's sleep-mode pool is outside it), ``device_used_gb`` what the whole device had in use
when the phase ended (every allocator and process, vLLM's weights and KV cache included). On CPU nothing
is recorded. Leaves out: host memory.
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
        try:
            yield
        finally:
            free, total = torch.cuda.mem_get_info()
            self.peaks[f"memory/{phase}/max_allocated_gb"] = torch.cuda.max_memory_allocated() / _GB
            self.peaks[f"memory/{phase}/device_used_gb"] = (total - free) / _GB

    def as_metrics(self) -> dict[str, float]:
        """What was recorded since the last call (then forgotten: one step's phases at a time)."""
        metrics, self.peaks = self.peaks, {}
        return metrics
