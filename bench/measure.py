"""Shared measurement pieces of the benchmarks: timing, device ceilings, one-rank bring-up, result files.

* :func:`time_region` runs a callable ``warmup`` + ``iters`` times and returns per-iteration seconds,
  synchronising the device around each timed call (host clock; events would hide nothing here because
  every timed region is a whole training step or pass, milliseconds to seconds long);
* :func:`measure_matmul_tflops` and :func:`measure_copy_gbps` measure this device's bf16 matmul rate and
  device-to-device copy bandwidth in the same process as the benchmark, so MFU and GB/s can be read
  against a measured ceiling as well as the datasheet;
* :func:`bring_up_single_rank` makes a one-process torch.distributed world (nccl on GPU, gloo on CPU)
  with megatron's parallel state;
* :func:`environment` records versions, device and date for ``docs/device_runs.md``.

Left out: multi-rank launching (the benchmarks here are one GPU) and profiling.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import time
from typing import Any, Callable

import torch

H200_SPEC_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM datasheet, dense (no sparsity)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_region(fn: Callable[[], Any], *, device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    seconds = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def summarize(seconds: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "iters": len(seconds)}


def measure_matmul_tflops(device: torch.device, *, n: int = 8192, iters: int = 10) -> float:
    """bf16 ``n x n x n`` products on random data (never zeros: they run faster than real data)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_region(lambda: a @ b, device=device, warmup=3, iters=iters)
    return 2 * n**3 / statistics.median(seconds) / 1e12


def measure_copy_gbps(device: torch.device, *, num_bytes: int = 4 * 2**30, iters: int = 10) -> float:
    """Payload GB/s of one large ``copy_`` (bytes copied once; read + write traffic is twice this)."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = time_region(lambda: dst.copy_(src), device=device, warmup=3, iters=iters)
    return num_bytes / statistics.median(seconds) / 1e9


def bring_up_single_rank(layout=None, *, seed: int = 1234):
    """One-process world + megatron parallel state (TP=PP=1 unless ``layout`` says otherwise)."""
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return initialize_megatron_parallel(layout=layout or ParallelLayout(), seed=seed)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
    return torch.device(requested)


def peak_memory_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def allocator_retries(device: torch.device) -> int:
    """cudaMalloc retries since the last reset: each one frees cached blocks and synchronises the device
    (a sign of fragmentation near the memory limit, e.g. from micro-batches of varying size)."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    try:
        from megatron.core import package_info

        mcore = package_info.__version__
    except Exception:  # very old layouts keep the version elsewhere; the report must not fail on it
        mcore = "unknown"
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "megatron_core": mcore, "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   sm_count=props.multi_processor_count)
    return env


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2, default=str)
    print(text)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text + "\n")
