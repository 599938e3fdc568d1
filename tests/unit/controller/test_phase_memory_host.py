"""``memory/<phase>/host_peak_gb``: the most host memory the worker process held during the phase, each phase
counted from its own start (the 7B run's host share of Adam is compared with the planner's by it)."""

import re

import pytest
import torch

from megarl.controller.phase_memory import PhaseMemory

MIB = 2**20
SLACK = 48 * MIB  # the interpreter's own allocations between the reads


def _resident_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def test_each_phase_reports_its_own_peak_of_resident_host_memory():
    memory = PhaseMemory("cpu")
    if not memory.host_enabled:
        pytest.skip("no /proc/self/clear_refs here (not Linux)")
    with memory.track("big"):
        resident_before = _resident_bytes()
        block = torch.ones(384 * MIB // 4)  # touched pages: resident
        del block
    with memory.track("small"):
        resident_small = _resident_bytes()
        block = torch.ones(32 * MIB // 4)
        del block
    metrics = memory.as_metrics()
    assert set(metrics) == {"memory/big/host_peak_gb", "memory/small/host_peak_gb"}  # no device figures on CPU
    big, small = metrics["memory/big/host_peak_gb"] * 1e9, metrics["memory/small/host_peak_gb"] * 1e9
    assert big >= resident_before + 384 * MIB - SLACK, (big, resident_before)
    # the second phase starts from its own resident size, not from the first phase's high-water mark
    assert resident_small + 32 * MIB - SLACK <= small <= resident_small + 32 * MIB + SLACK, (small, resident_small)
    assert memory.as_metrics() == {}
