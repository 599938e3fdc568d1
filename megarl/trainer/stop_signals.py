"""Stop cleanly when the scheduler says so: SIGTERM (Slurm's ``--signal=B:TERM@300``, ``scancel``, Kubernetes)
or SIGUSR1 finish the current step, write a checkpoint and end the run with exit code 0.

``StopSignals`` installs its handlers for the duration of a ``with`` block (main thread only; elsewhere it
installs nothing) and restores the previous ones after. The handler only records the signal: the loop looks
at ``requested`` between steps, so no collective is interrupted half-way. A second signal while stopping is
left to the previous handler (the default kills), so an impatient scheduler still can.
Leaves out: abandoning a step in the middle (a step that cannot finish before the hard kill is lost; the
previous checkpoint stays).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    def __init__(self) -> None:
        self.received: Optional[str] = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # asked twice: let the previous disposition act
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name
        print(f"[megarl] {self.received} received: finishing this step, then a checkpoint and exit", flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
