"""Where training metrics go: console, TensorBoard event files, a JSONL file (one line per step), and the
experiment trackers of megarl.trainer.trackers (wandb, mlflow, swanlab) opened by the caller.

``MetricsLogger.log(metrics, step)`` fans a flat ``{"group/name": float}`` dict out to every backend
asked for. It also holds the per-stage timer used by the loop. It does not compute metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from megarl.trainer.trackers import Tracker

CONSOLE_KEYS = (
    "critic/score/mean", "val/score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
    "actor/pg_clipfrac", "response_length/mean", "perf/tokens_per_s", "timing_s/step",
)


def _console_name(key: str) -> str:
    """``timing_s/step`` reads ``step_time_s`` on the console (a bare ``step=0.28`` beside ``step 3:`` was read
    as a step number); other keys as they are."""
    return f"{key.split('/', 1)[1]}_time_s" if key.startswith("timing_s/") else key


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class MetricsLogger:
    def __init__(self, backends: Iterable[str], log_dir: str | Path, *, stream=None, trackers: Sequence[Tracker] = ()):
        self.backends = list(backends)
        self.trackers = list(trackers)
        self.log_dir = Path(log_dir)
        self.stream = stream or sys.stdout
        self._tb = None
        self._jsonl = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
        if "jsonl" in self.backends:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)

    @property
    def jsonl_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    def log(self, metrics: dict, step: int) -> None:
        flat = {k: _plain(v) for k, v in metrics.items()}
        if self._tb is not None:
            for key, value in flat.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **flat}) + "\n")
        for tracker in self.trackers:
            tracker.log(flat, step)
        if "console" in self.backends:
            shown = [f"{_console_name(k)}={flat[k]:.4g}" for k in CONSOLE_KEYS if k in flat]
            # tqdm.write keeps the line and a live progress bar from overwriting each other.
            tqdm.write(f"step {step}: " + "  ".join(shown), file=self.stream)
            self.stream.flush()

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of text to the loggers that show tables: TensorBoard's text tab (a markdown table),
        ``<log_dir>/<name>.jsonl`` (one line per call: the step and its rows) and the trackers."""
        if not rows:
            return
        for tracker in self.trackers:
            tracker.log_table(name, rows, step)
        if self._tb is not None:
            columns = list(rows[0])

            def cell(value) -> str:  # one markdown cell: no column breaks, no line breaks
                return str(value).replace("|", "\\|").replace("\n", " ")

            lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
            lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
            self._tb.add_text(name, "\n".join(lines), global_step=step)
            self._tb.flush()
        if "jsonl" in self.backends:
            with open(self.log_dir / f"{name}.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step, "rows": rows}, default=str) + "\n")

    def forget_after(self, step: int) -> None:
        """Drop the JSONL rows of steps after ``step`` (a resumed run trains them again), atomically.
        TensorBoard files are append-only: a re-trained step appears there twice, the later value last."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        kept = [row for row in read_jsonl_metrics(self.jsonl_path) if row.get("step", 0) <= step]
        partial = self.jsonl_path.with_suffix(".jsonl.partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in kept))
        partial.replace(self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a", buffering=1)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


@contextlib.contextmanager
def timed(name: str, into: dict) -> Iterator[None]:
    """Add the wall time of the block to ``into["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        into[key] = into.get(key, 0.0) + time.perf_counter() - start


def read_jsonl_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics file; a last line cut short by a kill is skipped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for index, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise ValueError(f"{path}: line {index + 1} is not JSON") from None
    return rows
