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

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from megarl.checkpoint_io.files import TRACKER_FILE, mark_latest, tracked_iteration, write_atomically
from megarl.engines.megatron.checkpoint import has_complete_checkpoint

MARKER = TRACKER_FILE  # Megatron-LM's tracker, here naming the newest complete global_step_N


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

    def failed_write(self, step: int, staging: Path, error: BaseException) -> BaseException:
        """What to raise when writing ``staging`` failed: the staging directory is removed (the last complete
        checkpoint is untouched), and a full disk is said in words, with where and how much, instead of the
        writer's own message (torch's is "unexpected pos 704 vs 598")."""
        written = _tree_bytes(staging)
        free = shutil.disk_usage(self.root).free  # before the partial write gives its space back
        shutil.rmtree(staging, ignore_errors=True)
        latest = self.latest_step()
        previous = _tree_bytes(self.step_dir(latest)) if latest is not None else 0
        # What the rest of this checkpoint needed: the previous one's size less what was written (the first
        # checkpoint: at least as much again as it had written), with 1 MiB for files of its own.
        still_needed = (previous - written if previous else written) + (1 << 20)
        if not (_is_disk_full(error) or free < still_needed):
            return error
        kept = f"step {latest} is the last complete checkpoint, untouched" if latest is not None else \
            "there is no earlier checkpoint"
        return OSError(errno.ENOSPC, (
            f"checkpoint of step {step} could not be written: the disk holding {self.root} is full "
            f"({free:,} bytes free; this checkpoint had written {written:,} bytes when it failed, the previous one "
            f"takes {previous:,}). Free space or set trainer.default_local_dir elsewhere (trainer.max_ckpt_to_keep "
            f"bounds how many are kept); {kept}. The writer said: {type(error).__name__}: {error}"))

    def commit(self, step: int, staging: Path, trainer_state: dict, *, roles: tuple[str, ...] = ()) -> Path:
        """Make ``staging`` the checkpoint of ``step``. Each of ``roles`` (subdirectories written by the workers)
        must hold a complete engine checkpoint (its tracker file, written last by the engine): a worker that
        wrote somewhere else must not leave a committed checkpoint without its state."""
        for role in roles:
            if not has_complete_checkpoint(str(staging / role)):
                raise RuntimeError(
                    f"checkpoint of step {step} not committed: {staging / role} holds no complete {role} state. The "
                    f"workers must see trainer.default_local_dir={self.root.parent} at the same path as the driver "
                    f"(a filesystem shared by every node)")
        write_atomically(staging / "trainer_state.json", json.dumps(trainer_state, indent=1))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        mark_latest(self.root, step)
        self._prune()
        return final

    def latest_step(self) -> Optional[int]:
        marker = self.root / MARKER
        try:
            step = tracked_iteration(self.root)
        except ValueError:  # the tracker's own words are Megatron-LM's (iterations); the trainer's are steps
            step = -1
        if step is None:
            return None
        if step < 0:
            raise ValueError(f"{marker}: expected a step number, found {marker.read_text().strip()!r}")
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


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def _is_disk_full(error: BaseException) -> bool:
    """ENOSPC anywhere in the cause chain or the message (Ray and torch re-wrap it as text)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
