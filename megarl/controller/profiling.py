"""Profiling chosen training steps in every worker (verl's ``global_profiler``).

``global_profiler.tool=torch``: each worker process records the step with the torch profiler (CPU, and CUDA
kernels on GPUs) and writes a Chrome trace, ``<save_path>/step_<n>/<WorkerClass>_rank<r>.pt.trace.json``, that
Perfetto (ui.perfetto.dev) or TensorBoard's profiler plugin opens. ``tool=nsys``: the step is a CUDA profiler
capture range (run the job under ``nsys profile --capture-range=cudaProfilerApi``). Either way every worker method
the step calls is a named range, ``megarl/<method>`` (``generate``, ``compute_log_probs``, ``update_actor``,
``sync_weights``, ...): a torch profiler ``record_function`` and an NVTX range on CUDA.

The ranges come from where every worker method runs (the Ray worker host and the in-process group call
:func:`stage_range`); the capture starts and stops through :class:`ProfiledWorker`'s methods, which every worker
class has.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from megarl.controller.dispatch import Collect, Dispatch, register

PROFILER_TOOLS = ("torch", "nsys")


class _Capture:
    """This process's capture in progress, if any."""

    tool: Optional[str] = None
    profiler = None
    trace_path: Optional[Path] = None


_capture = _Capture()


@contextlib.contextmanager
def stage_range(name: str) -> Iterator[None]:
    """``megarl/<name>`` around a worker method while a step is profiled (nothing otherwise)."""
    if _capture.tool is None:
        yield
        return
    label = f"megarl/{name}"
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    if nvtx:
        torch.cuda.nvtx.range_push(label)
    try:
        with torch.profiler.record_function(label):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ProfiledWorker:
    """The capture's start and end on every rank of a worker group."""

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def start_profile(self, save_path: str, step: int, tool: str) -> None:
        if tool not in PROFILER_TOOLS:
            raise ValueError(f"global_profiler.tool={tool!r}: one of {PROFILER_TOOLS}")
        if _capture.tool is not None:
            raise RuntimeError("a profiled step is already being captured in this process")
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if tool == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            directory = Path(save_path) / f"step_{step}"
            directory.mkdir(parents=True, exist_ok=True)
            _capture.trace_path = directory / f"{type(self).__name__}_rank{_rank()}_pid{os.getpid()}.pt.trace.json"
            _capture.profiler = torch.profiler.profile(activities=activities)
            _capture.profiler.start()
        elif on_cuda:
            torch.cuda.profiler.start()
        _capture.tool = tool

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def stop_profile(self) -> Optional[str]:
        """End the capture; the trace file written (torch), else None."""
        tool, _capture.tool = _capture.tool, None
        if tool == "torch":
            _capture.profiler.stop()
            _capture.profiler.export_chrome_trace(str(_capture.trace_path))
            _capture.profiler = None
            return str(_capture.trace_path)
        if tool == "nsys" and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.profiler.stop()
        return None
