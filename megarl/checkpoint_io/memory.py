"""Byte-size parsing ("5GB") and the process' resident-set high-water mark, for budgets and benchmarks.

Left out: cgroup accounting (page cache of written files is not counted: it is reclaimable).
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_bytes() -> int:
    """VmHWM: the most resident memory this process has held so far (or since :func:`reset_peak_rss`)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set this process's VmHWM to its resident size now (Linux 4.0 and later; OSError where it cannot)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def current_rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def largest_child_peak_rss_bytes() -> int:
    """The largest resident-set high-water mark among this process' finished children (worker processes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
