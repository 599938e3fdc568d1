"""Checkpoint directories of a run, written so that an interrupted save is never taken as the latest.

Layout under ``root``::

    global_step_40/            one finished checkpoint: actor/, critic/ (engine-written), trainer_state.json
    latest_checkpointed_iteration.txt   the step of the newest finished checkpoint (written last, atomically)

A save goes to ``global_step_N.partial`` first; the engines write their parts into it, the trainer state
is added, then it is renamed to ``global_step_N`` and only then is the marker replaced. A crash at any
point leaves at worst a ``.partial`` directory, which resume ignores and the next save removes. Old
checkpoints beyond ``max_to_keep`` are deleted after the marker moved on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

MARKER = "latest_checkpointed_iteration.txt"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str | Path, *, max_to_keep: Optional[int] = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def begin(self, step: int) -> Path:
        """A fresh staging directory for step ``step`` (a leftover from a crashed save is removed)."""
        staging = self.root / f"global_step_{step}.partial"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        return staging

    def commit(self, step: int, staging: Path, trainer_state: dict) -> Path:
        _atomic_write_text(staging / "trainer_state.json", json.dumps(trainer_state, indent=1))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _atomic_write_text(self.root / MARKER, str(step))
        self._prune()
        return final

    def latest_step(self) -> Optional[int]:
        marker = self.root / MARKER
        if not marker.is_file():
            return None
        text = marker.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"{marker}: expected a step number, found {text!r}")
        step = int(text)
        if not (self.step_dir(step) / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{marker} names step {step}, but {self.step_dir(step)} is incomplete or missing")
        return step

    def load_trainer_state(self, step: int) -> dict:
        return json.loads((self.step_dir(step) / "trainer_state.json").read_text())

    def finished_steps(self) -> list[int]:
        steps = []
        for child in self.root.glob("global_step_*"):
            suffix = child.name.removeprefix("global_step_")
            if suffix.isdigit() and (child / "trainer_state.json").is_file():
                steps.append(int(suffix))
        return sorted(steps)

    def _prune(self) -> None:
        if not self.max_to_keep or self.max_to_keep < 1:
            return
        for step in self.finished_steps()[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
