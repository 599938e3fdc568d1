"""A small watcher process that kills what a SIGKILLed driver leaves behind.

A local Ray cluster (``ray.init()`` without an address) is made of the driver's child processes. When the
driver is SIGKILLed nothing of it runs: the raylet and the workers notice and exit, but Ray's dashboard and
runtime-env agents were seen to outlive it for minutes. ``start_orphan_reaper()`` starts this module as its own
process (its own session, so a signal to the driver's group does not take it too); every second it records the
driver's descendants (pid and start time, from ``/proc``), and once the driver is gone it SIGKILLs every
recorded process still alive with the same start time, then exits. ``stop_orphan_reaper()`` (a normal
shutdown) ends it without killing anything. Linux only (elsewhere it is not started).
Leaves out: clusters started by ``ray start`` (their processes belong to the node, not to a run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

_reaper: Optional[subprocess.Popen] = None


def _start_time(pid: int) -> Optional[str]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19]  # starttime (field 22 of stat; 20 after the "(comm)" split)


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every living descendant of ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            start = _start_time(child)
            if start is not None and child != os.getpid():
                found.add((child, start))
                stack.append(child)
    return found


def _watch(driver: int, driver_start: str) -> None:
    known: set[tuple[int, str]] = set()
    while _start_time(driver) == driver_start:
        known |= descendants(driver)
        time.sleep(1.0)
    for pid, start in known:
        if _start_time(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_orphan_reaper() -> None:
    global _reaper
    if _reaper is not None or not sys.platform.startswith("linux"):
        return
    _reaper = subprocess.Popen([sys.executable, "-m", "megarl.controller.orphan_reaper", str(os.getpid()),
                                _start_time(os.getpid()) or ""],
                               start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)


def stop_orphan_reaper() -> None:
    global _reaper
    if _reaper is not None:
        _reaper.terminate()
        _reaper.wait(timeout=10)
        _reaper = None


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
