"""Named points where a test can kill a worker process, to check what a real crash does to a run.

``MEGARL_KILL_AT=<point>[:<n>]`` in a worker's environment makes the n-th arrival (default the first) at
``kill_point(<point>)`` SIGKILL the process, as a scheduler's OOM killer or a failing node would: no cleanup,
no exception. The points: ``save_checkpoint`` (every shard written, the checkpoint not yet committed:
where a crash is hardest on a run), ``rollout_generate`` (a separate rollout worker starting a generation,
which asynchronous training runs beside the trainer) and ``rollout_receive_weights`` (a separate rollout worker
taking a weight bucket from training rank 0). Unset (always, outside tests) it costs one dict lookup.
Leaves out: delays and partial network failures.
"""

from __future__ import annotations

import os
import signal

ENV = "MEGARL_KILL_AT"
_arrivals: dict[str, int] = {}


def kill_point(name: str) -> None:
    target = os.environ.get(ENV)
    if not target:
        return
    point, _, nth = target.partition(":")
    if point != name:
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    if _arrivals[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
