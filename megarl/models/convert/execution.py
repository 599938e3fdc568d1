"""Run a conversion plan: independent tasks (each writes a few whole files), resumable, optionally parallel.

A plan is a list of :class:`Task` s; a task writes one or more output files completely (through
:class:`~megarl.models.convert.safetensors_stream.StreamingSafetensorsWriter`, so each file appears
atomically). The parent process records every finished file in ``.convert_progress.jsonl`` (size and
CRC32, one fsynced line per file) under the output directory. The first line holds a hash of the
plan: rerunning with the same inputs and options resumes (finished tasks are skipped, stray temp
files are removed); rerunning with different ones into the same directory is refused.

Workers are ``spawn`` ed processes (fork after torch has started threads can deadlock); each builds its
own context once (bridge, source index) and then runs tasks. With ``workers=1`` everything runs in the
calling process.

Fault injection for tests: ``MEGARL_CONVERT_KILL_AFTER_TENSORS=N`` makes a process SIGKILL itself
after writing its N-th tensor (mid-file), the way an OOM kill or a node failure would stop it.

Left out: distributing one conversion over several machines (run one converter per node on disjoint
output ranks instead; the format does not need a coordinator).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from megarl.models.convert.safetensors_stream import PlannedTensor, fsync_directory

logger = logging.getLogger(__name__)

PROGRESS_FILE = ".convert_progress.jsonl"
KILL_AFTER_ENV = "MEGARL_CONVERT_KILL_AFTER_TENSORS"


@dataclass(frozen=True)
class OutputFile:
    rel_path: str
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Task:
    task_id: str
    files: tuple[OutputFile, ...]
    payload: Any = None  # direction-specific: what to read and how to build each planned tensor

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


@dataclass
class FileRecord:
    size: int
    crc32: int


def hash_plan(tasks: list[Task], extra: Any) -> str:
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for task in tasks:
        for out in task.files:
            digest.update(out.rel_path.encode())
            for t in out.tensors:
                digest.update(f"{t.name}|{t.dtype}|{t.shape};".encode())
    return digest.hexdigest()


class ProgressManifest:
    """The append-only record of finished output files, used to resume."""

    def __init__(self, out_dir: str, plan_hash: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, PROGRESS_FILE)
        self.done: dict[str, FileRecord] = {}
        os.makedirs(out_dir, exist_ok=True)
        if os.path.isfile(self.path):
            self._load(plan_hash)
        else:
            self._append({"plan_hash": plan_hash})
        self._remove_stray_temp_files()

    def _load(self, plan_hash: str) -> None:
        with open(self.path) as handle:
            lines = [line for line in handle.read().splitlines() if line.strip()]
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # a torn last line from a kill mid-append: that file is redone
                    break
                raise ValueError(f"{self.path}: line {number} is not JSON") from None
        if not records or records[0].get("plan_hash") != plan_hash:
            raise ValueError(f"{self.out_dir} holds an unfinished conversion with different inputs or options "
                             f"(plan hash mismatch in {PROGRESS_FILE}); use an empty output directory")
        for record in records[1:]:
            self.done[record["file"]] = FileRecord(record["size"], record["crc32"])

    def _remove_stray_temp_files(self) -> None:
        for root, _, files in os.walk(self.out_dir):
            for name in files:
                if ".tmp-" in name:
                    os.remove(os.path.join(root, name))

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def record(self, rel_path: str, size: int, crc32: int) -> None:
        self._append({"file": rel_path, "size": size, "crc32": crc32})
        self.done[rel_path] = FileRecord(size, crc32)

    def is_done(self, task: Task) -> bool:
        for out in task.files:
            record = self.done.get(out.rel_path)
            path = os.path.join(self.out_dir, out.rel_path)
            if record is None or not os.path.isfile(path) or os.path.getsize(path) != record.size:
                return False
        return True

    def remove(self) -> None:
        os.remove(self.path)
        fsync_directory(self.out_dir)


_tensors_written = 0


def note_tensor_written() -> None:
    """Called after each tensor reaches a file; implements the kill-after-N fault injection."""
    global _tensors_written
    _tensors_written += 1
    limit = os.environ.get(KILL_AFTER_ENV)
    if limit and _tensors_written >= int(limit):
        logger.warning("%s=%s reached: killing this process (fault injection)", KILL_AFTER_ENV, limit)
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------- runner
TaskFn = Callable[[Any, Task], list[tuple[str, int, int]]]
_WORKER: dict[str, Any] = {}


def _init_worker(make_context: Callable[..., Any], context_args: tuple, run_task: TaskFn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # workers are the parallelism; intra-op threads would oversubscribe cores
    _WORKER["context"] = make_context(*context_args)
    _WORKER["run_task"] = run_task


def _run_in_worker(task: Task):
    return task, _WORKER["run_task"](_WORKER["context"], task)


@dataclass
class RunStats:
    tasks_total: int = 0
    tasks_skipped: int = 0
    bytes_written: int = 0
    records: dict[str, FileRecord] = field(default_factory=dict)


def run_tasks(tasks: list[Task], *, out_dir: str, plan_hash: str, workers: int,
              make_context: Callable[..., Any], context_args: tuple, run_task: TaskFn,
              description: str) -> RunStats:
    """Run every unfinished task; returns the records of all output files (old and new)."""
    from tqdm import tqdm

    manifest = ProgressManifest(out_dir, plan_hash)
    todo = [task for task in tasks if not manifest.is_done(task)]
    stats = RunStats(tasks_total=len(tasks), tasks_skipped=len(tasks) - len(todo))
    if stats.tasks_skipped:
        logger.info("resuming: %d of %d tasks already finished in %s", stats.tasks_skipped, len(tasks), out_dir)
    bar = tqdm(total=sum(t.nbytes for t in todo), unit="B", unit_scale=True, desc=description, disable=None)

    def finish(task: Task, results: list[tuple[str, int, int]]) -> None:
        for rel_path, size, crc in results:
            manifest.record(rel_path, size, crc)
            stats.bytes_written += size
        bar.update(task.nbytes)

    finished: set[str] = set()
    try:
        if workers <= 1 or len(todo) <= 1:
            context = make_context(*context_args)
            for task in todo:
                finish(task, run_task(context, task))
                finished.add(task.task_id)
        else:
            ctx = mp.get_context("spawn")
            with ctx.Pool(min(workers, len(todo)), initializer=_init_worker,
                          initargs=(make_context, context_args, run_task), maxtasksperchild=None) as pool:
                for task, results in pool.imap_unordered(_run_in_worker, todo):
                    finish(task, results)
                    finished.add(task.task_id)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        remaining = sum(task.nbytes for task in todo if task.task_id not in finished)
        done = len(finished) + stats.tasks_skipped
        free = shutil.disk_usage(out_dir).free
        raise OSError(errno.ENOSPC, f"{description}: the disk holding {out_dir} is full ({free:,} bytes free) "
                                    f"with {done} of {len(tasks)} tasks done; the rest needs about {remaining:,} "
                                    f"bytes. Free space and rerun the same command: it resumes from the finished "
                                    f"files") from error
    finally:
        bar.close()
    stats.records = dict(manifest.done)
    return stats
