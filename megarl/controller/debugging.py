"""Debugging worker code: what the worker groups do differently while a person steps through a rank.

* ``MEGARL_BREAK_AT=<method>[:<rank>]`` on the driver stops every call of that worker method (on every rank, or
  on one) at a breakpoint just before it runs, without editing code: ``_WorkerHost.execute`` asks
  :func:`break_requested`. The debugger shows the worker, the method's name and its arguments; step in.
* A call's watchdog (``trainer.worker_timeout_s``) does not fire while one of its ranks sits at a breakpoint:
  at the deadline the worker group reads the pending ranks' stacks (it does so anyway, to report a hang) and
  when one of them is inside a debugger (:func:`sits_at_breakpoint`), or could not be read while debugging is
  on, it waits another period instead (:func:`reason_to_wait_on`).
* With debugging on, the ranks' collectives wait up to :data:`DEBUG_COLLECTIVE_TIMEOUT_S` (the peers of a
  paused rank sit in their next collective), not ``trainer.worker_timeout_s``.

Which debugger, and how debugging is turned on: megarl.controller.ray_cluster (``MEGARL_RAY_DEBUG`` or Ray's own
``RAY_DEBUG``, forwarded to the workers, which then also have Ray's dashboard to find breakpoints by).
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

BREAK_ENV = "MEGARL_BREAK_AT"
DEBUG_COLLECTIVE_TIMEOUT_S = 24 * 3600.0
# Frames of a thread stopped in a debugger: debugpy/pydevd (Ray's default debugger), Ray's remote pdb
# (RAY_DEBUG=legacy), plain pdb (trainer.backend=inprocess).
_DEBUGGER_FRAMES = ("/pydevd.py", "/_pydevd_bundle/", "/ray/util/debugpy.py", "/ray/util/rpdb.py", "/pdb.py",
                    "/bdb.py")


def break_requested(method: str, rank: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``MEGARL_BREAK_AT`` asks to stop before ``method`` on ``rank``."""
    target = (os.environ if environ is None else environ).get(BREAK_ENV, "")
    if not target:
        return False
    name, _, only_rank = target.partition(":")
    if only_rank and not only_rank.isdigit():
        raise ValueError(f"{BREAK_ENV}={target!r}: expected <method> or <method>:<rank>")
    return name == method and (not only_rank or int(only_rank) == rank)


def sits_at_breakpoint(stack: str) -> bool:
    """Whether a faulthandler dump of a Ray worker shows its main thread (the one running the actor's methods,
    whose oldest frame is Ray's ``default_worker.py``) stopped in a debugger. Only that thread: debugpy's own
    threads stay in the process, in pydevd's frames, after the person has continued."""
    threads, current = [], None
    for line in stack.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = []
            threads.append(current)
        elif current is not None and line.lstrip().startswith("File "):
            current.append(line)
    main = [frames for frames in threads if frames and "default_worker.py" in frames[-1]]
    return any(marker in line for frames in main for line in frames for marker in _DEBUGGER_FRAMES)


def reason_to_wait_on(stacks: Mapping[int, str], unreadable: Sequence[int],
                      debugging: Mapping[int, bool]) -> str | None:
    """At a call's deadline, given the pending ranks' stacks, the ranks whose stacks could not be read, and
    whether each rank runs with a debugger on: why the watchdog should wait another period, or None (a hang)."""
    paused = sorted(rank for rank, stack in stacks.items() if sits_at_breakpoint(stack))
    if paused:
        return f"rank(s) {paused} sit at a debugger breakpoint"
    # With a debugger on, a rank whose stacks could not be read (the read timed out on a loaded node, say) may be
    # the one a person is stepping through: killing the run under them is the worse mistake.
    unknown = sorted(rank for rank in unreadable if debugging.get(rank))
    if unknown:
        return f"the stacks of rank(s) {unknown} could not be read and debugging is on"
    return None


def debugging_on(environ: Mapping[str, str] | None = None) -> bool:
    """In a worker: megarl's driver turned a debugger on for this job (it forwards ``RAY_DEBUG`` only then)."""
    return bool((os.environ if environ is None else environ).get("RAY_DEBUG"))


def collective_timeout_s(worker_timeout_s: float, environ: Mapping[str, str] | None = None) -> float:
    return max(worker_timeout_s, DEBUG_COLLECTIVE_TIMEOUT_S) if debugging_on(environ) else worker_timeout_s
