"""Where a GPU waits on its host: idle gaps in a torch.profiler chrome trace, summed by the host code that
launched the first kernel after each gap.

    python bench/trace_gaps.py TRACE.json[.gz] [--min-gap-us 20] [--top 25]

A gap is a stretch with no kernel, memcpy or memset running. The kernel that ends it was launched by a CUDA
runtime call (matched by correlation id); the gap is charged to the innermost Python frames (a trace recorded
with ``with_stack=True``) or, without them, the innermost ``aten`` op around that launch. A launch made long
before the gap ended points at the device (a dependency, a stream wait), not the host: those gaps are listed
apart. Host waits (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and
device-to-host copies) are counted with their call sites too, since each one empties the GPU's queue.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
from typing import Optional

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
WAIT_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X"]


class HostStacks:
    """Innermost enclosing Python frames / CPU ops of a host time, per thread."""

    def __init__(self, events: list[dict]):
        self.by_thread: dict = collections.defaultdict(list)
        for event in events:
            if event.get("cat") in ("python_function", "cpu_op"):
                self.by_thread[event["tid"]].append(event)
        for spans in self.by_thread.values():
            spans.sort(key=lambda e: e["ts"])
        self.starts = {tid: [e["ts"] for e in spans] for tid, spans in self.by_thread.items()}

    def site(self, tid, ts: float, depth: int = 3) -> str:
        spans, starts = self.by_thread.get(tid, []), self.starts.get(tid, [])
        enclosing = []
        # spans are nested, so the enclosing ones start before ts; a bounded look back keeps this cheap
        for index in range(bisect.bisect_right(starts, ts) - 1, max(-1, bisect.bisect_right(starts, ts) - 4000), -1):
            event = spans[index]
            if event["ts"] + event.get("dur", 0) >= ts:
                enclosing.append(event)
        python = [e for e in enclosing if e.get("cat") == "python_function" and _interesting(e["name"])]
        chosen = python if python else [e for e in enclosing if e.get("cat") == "cpu_op"]
        chosen.sort(key=lambda e: -e["ts"])  # innermost first
        return " <- ".join(_short(e["name"]) for e in chosen[:depth]) or "(no host op)"


def _interesting(name: str) -> bool:
    return any(key in name for key in ("megarl", "megatron", "bench/")) and "trace_gaps" not in name


def _short(name: str) -> str:
    # "path/to/file.py(123): function" -> "file.py:123 function"
    if ".py(" in name:
        path, _, rest = name.partition("(")
        line, _, function = rest.partition("): ")
        return f"{os.path.basename(path)}:{line} {function}"
    return name[:80]


def analyse(events: list[dict], min_gap_us: float = 20.0) -> dict:
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        raise ValueError("the trace holds no GPU kernels")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    stacks = HostStacks(events)
    first, last = device[0]["ts"], max(e["ts"] + e.get("dur", 0) for e in device)
    busy_until, busy = first, 0.0
    host_late: collections.Counter = collections.Counter()
    device_side: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for event in device:
        start, end = event["ts"], event["ts"] + event.get("dur", 0)
        if start > busy_until and start - busy_until >= min_gap_us:
            gap = start - busy_until
            launch = launches.get(event.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] >= busy_until:  # launched during the gap: the host was late
                key = stacks.site(launch["tid"], launch["ts"])
                host_late[key] += gap
                counts[key] += 1
            else:
                device_side[event["name"][:80]] += gap
        busy += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    waits: collections.Counter = collections.Counter()
    wait_time: collections.Counter = collections.Counter()
    for event in events:
        name = event.get("name", "")
        is_d2h = name == "cudaMemcpyAsync" and event.get("dur", 0) > 50  # a blocking copy back to the host
        if event.get("cat") == "cuda_runtime" and (name in WAIT_NAMES or is_d2h):
            key = f"{name} @ {stacks.site(event['tid'], event['ts'])}"
            waits[key] += 1
            wait_time[key] += event.get("dur", 0)
    span = last - first
    return {
        "span_ms": span / 1e3, "busy_ms": busy / 1e3, "busy_fraction": busy / span,
        "idle_ms_host_late": sum(host_late.values()) / 1e3, "idle_ms_device_side": sum(device_side.values()) / 1e3,
        "host_late": [{"site": k, "idle_ms": v / 1e3, "gaps": counts[k]} for k, v in host_late.most_common()],
        "device_side": [{"kernel": k, "idle_ms": v / 1e3} for k, v in device_side.most_common()],
        "host_waits": [{"site": k, "calls": waits[k], "ms": wait_time[k] / 1e3} for k, _ in wait_time.most_common()],
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    result = analyse(load_events(args.trace), args.min_gap_us)
    print(f"span {result['span_ms']:.1f} ms, GPU busy {result['busy_ms']:.1f} ms ({result['busy_fraction']:.1%}); "
          f"idle in gaps >= {args.min_gap_us:g} us: host late {result['idle_ms_host_late']:.1f} ms, "
          f"device-side {result['idle_ms_device_side']:.1f} ms")
    print("\nidle ms  gaps  host code that launched the kernel after the gap")
    for row in result["host_late"][:args.top]:
        print(f"{row['idle_ms']:7.2f} {row['gaps']:5d}  {row['site']}")
    print("\nhost waits (calls, ms): site")
    for row in result["host_waits"][:args.top]:
        print(f"{row['calls']:5d} {row['ms']:8.2f}  {row['site']}")
    return result


if __name__ == "__main__":
    main()
