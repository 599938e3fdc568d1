"""One run per output directory: an exclusive lock on ``<default_local_dir>/.lock`` naming its holder.

Two runs writing the same checkpoints and metrics would corrupt each other's resume state. The lock is an
``flock`` on an open file, so the kernel drops it when the holder dies (SIGKILL included): a stale lock file
never blocks a rerun. The file's text says who holds it (pid, host, start time) for the error message.
Leaves out: filesystems without flock semantics across hosts (some NFS setups): there the lock is per host.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path


class RunDirectoryInUse(RuntimeError):
    pass


class RunLock:
    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "an unknown process"
            self._file.close()
            raise RunDirectoryInUse(
                f"trainer.default_local_dir={self.path.parent} is in use by {holder}: another run is writing "
                f"there; wait for it, stop it, or choose another trainer.default_local_dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
