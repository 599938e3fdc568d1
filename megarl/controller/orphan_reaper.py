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


def _stat(pid: int | str) -> Optional[tuple[int, str]]:
    """(parent pid, start time) from ``/proc/<pid>/stat``; None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]  # ppid and starttime: fields 4 and 22, after the "(comm)" split
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> Optional[str]:
    stat = _stat(pid)
    return stat[1] if stat else None


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every living descendant of ``root``: one read of each process's stat."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and (stat := _stat(entry)) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child[0])
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
