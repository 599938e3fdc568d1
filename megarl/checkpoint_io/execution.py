"""Run a conversion plan: independent tasks (each writes a few whole files), resumable, optionally parallel.

A plan is a list of :class:`Task` s; a task writes one or more output files completely (through
:class:`~megarl.checkpoint_io.safetensors_stream.StreamingSafetensorsWriter`, so each file appears
atomically). The parent process records every finished file in ``.convert_progress.jsonl`` (size and
CRC32, one fsynced line per file) under the output directory. The first line holds a hash of the
plan: rerunning with the same inputs and options resumes (finished tasks are skipped, stray temp
files are removed); rerunning with different ones into the same directory is refused.

Workers are forked from this process when that is safe (one thread, CUDA not started: the converters' own
command lines), at once and before the plan, so that they carry its imports and are ready in a fraction of a
second; otherwise from a fresh ``forkserver`` process that imports torch and the task code once (a fork of a
process whose other threads may hold locks can deadlock; ``spawn`` makes every worker import torch itself,
which on a 16-core GPU host took 18 s for 16 workers at once). The fork server costs more than its imports:
on the 16-core GPU host its 16 workers were ready 9-10 s after the pool was made, because starting each one
needs this process's interpreter, busy importing megatron for the plan. Each worker gets the parent's
environment and builds its context once (plain data: the tensor rules, the output directory), then runs tasks.
With ``workers=1`` everything runs in the calling process.

Fault injection for tests: ``MEGARL_CONVERT_KILL_AFTER_TENSORS=N`` makes a process SIGKILL itself
after writing its N-th tensor (mid-file), the way an OOM kill or a node failure would stop it.

Left out: distributing one conversion over several machines (run one converter per node on disjoint
output ranks instead; the format does not need a coordinator).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from megarl.checkpoint_io.files import fsync_directory
from megarl.checkpoint_io.safetensors_stream import PlannedTensor

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
    crc32: Optional[int]  # None for a format that records none


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

    def record(self, rel_path: str, size: int, crc32: Optional[int]) -> None:
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
TaskFn = Callable[[Any, Task], list[tuple[str, int, Optional[int]]]]  # (file, size, CRC32 or None)
_WORKER: dict[str, Any] = {}


def _init_worker(environment: dict[str, str], make_context: Callable[..., Any], context_args: tuple,
                 run_task: TaskFn) -> None:
    # a forked worker has the fork server's environment, from when it started; the pool's owner's counts
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # workers are the parallelism; intra-op threads would oversubscribe cores
    _WORKER["context"] = make_context(*context_args)
    _WORKER["run_task"] = run_task
    _WORKER["ready_at"] = time.time()


def _run_in_worker(task: Task):
    started = time.time()
    results = _WORKER["run_task"](_WORKER["context"], task)
    return task, results, _WORKER["ready_at"], started, time.time()


def _ready_at() -> float:
    return _WORKER["ready_at"]


def forking_is_safe() -> bool:
    """Whether this process may fork its workers itself: it runs one thread (a fork copies only the thread that
    forks, so a lock another thread held would stay held in the child) and has not started CUDA (which a forked
    child cannot use). Threads that native libraries started (an OpenMP pool) do not count: the workers run
    one intra-op thread and never enter a parallel region."""
    if "fork" not in mp.get_all_start_methods() or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


class WorkerPool:
    """``workers`` processes, each with its context built once.

    Made before the plan so that their start-up (a fork, the context) overlaps the planning in this process
    instead of following it. A worker that dies (OOM killer, a signal) breaks the pool: the run fails at
    once, naming it, instead of waiting for a result that will not come. ``preload``: modules the tasks
    import lazily, imported once (here before forking, or in the fork server) instead of in every worker."""

    def __init__(self, workers: int, make_context: Callable[..., Any], context_args: tuple, run_task: TaskFn,
                 preload: tuple[str, ...] = ()):
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.created_at = time.time()
        modules = ["torch", __name__, make_context.__module__, run_task.__module__, *preload]
        self.forked_here = forking_is_safe()
        if self.forked_here:
            for module in modules:  # the workers inherit them
                importlib.import_module(module)
            start_method = mp.get_context("fork")
        elif "forkserver" in mp.get_all_start_methods():
            start_method = mp.get_context("forkserver")
            start_method.set_forkserver_preload(modules)  # used when this program's fork server starts
        else:
            start_method = mp.get_context("spawn")
        self.executor = ProcessPoolExecutor(workers, mp_context=start_method, initializer=_init_worker,
                                            initargs=(dict(os.environ), make_context, context_args, run_task))
        logger.info("%d conversion workers %s", workers, "forked from this process" if self.forked_here
                    else f"started by {start_method.get_start_method()} (this process runs other threads or CUDA)")
        self._starter: Optional[threading.Thread] = None
        if self.forked_here:
            self.executor.submit(_ready_at)  # forks every worker, before the executor starts its own thread
        else:
            # Otherwise executors add a process per submission that finds none idle: one call each starts all
            # of them. From a thread, because starting the first waits for the fork server's imports.
            self._starter = threading.Thread(target=self._start_all, name="conversion-workers-start", daemon=True)
            self._starter.start()

    def _start_all(self) -> None:
        for _ in range(self.workers):
            self.executor.submit(_ready_at)

    def __enter__(self) -> "WorkerPool":
        return self

    def _started(self) -> None:
        if self._starter is not None:
            self._starter.join()

    def __exit__(self, *exc) -> None:
        self._started()
        self.executor.shutdown(wait=True, cancel_futures=True)


@dataclass
class RunStats:
    tasks_total: int = 0
    tasks_skipped: int = 0
    bytes_written: int = 0  # the output files' sizes
    bytes_converted: int = 0  # the planned tensors' bytes of the tasks run
    records: dict[str, FileRecord] = field(default_factory=dict)
    seconds: float = 0.0  # running the tasks, from the first submitted to the last finished
    busy_seconds: float = 0.0  # the tasks' own times added up
    startup_seconds: float = 0.0  # from the pool's creation until its last used worker was ready
    slowest_task: tuple[str, float] = ("", 0.0)

    def summary(self, concurrency: int) -> str:
        ran = self.tasks_total - self.tasks_skipped
        use = self.busy_seconds / (self.seconds * concurrency) if self.seconds and concurrency else 0.0
        return (f"{ran} task(s) on {concurrency} worker(s) in {self.seconds:.1f} s, workers busy {use:.0%} of it "
                f"(start-up {self.startup_seconds:.1f} s; slowest task {self.slowest_task[0]} "
                f"{self.slowest_task[1]:.1f} s; {self.bytes_converted / 1e9:.2f} GB)")


def run_tasks(tasks: list[Task], *, out_dir: str, plan_hash: str, workers: int,
              make_context: Callable[..., Any], context_args: tuple, run_task: TaskFn,
              description: str, pool: Optional[WorkerPool] = None) -> RunStats:
    """Run every unfinished task, largest first (the last to finish is then a small one), at most ``workers``
    at a time, in ``pool`` if given (else in a pool made here, or in this process for one worker); returns
    the records of all output files (old and new) and the run's timings."""
    from tqdm import tqdm

    manifest = ProgressManifest(out_dir, plan_hash)
    todo = sorted((task for task in tasks if not manifest.is_done(task)), key=lambda task: -task.nbytes)
    stats = RunStats(tasks_total=len(tasks), tasks_skipped=len(tasks) - len(todo))
    if stats.tasks_skipped:
        logger.info("resuming: %d of %d tasks already finished in %s", stats.tasks_skipped, len(tasks), out_dir)
    concurrency = max(1, min(workers, len(todo)))
    own_pool = pool is None and concurrency > 1
    if own_pool:  # before the progress bar, whose monitor thread would keep the workers from being forked here
        pool = WorkerPool(concurrency, make_context, context_args, run_task)
    bar = tqdm(total=sum(t.nbytes for t in todo), unit="B", unit_scale=True, desc=description, disable=None)
    started = time.time()

    def finish(task: Task, results: list[tuple[str, int, Optional[int]]], task_started: float,
               task_ended: float) -> None:
        for rel_path, size, crc in results:
            manifest.record(rel_path, size, crc)
            stats.bytes_written += size
        stats.bytes_converted += task.nbytes
        stats.busy_seconds += task_ended - task_started
        if task_ended - task_started >= stats.slowest_task[1]:
            stats.slowest_task = (task.task_id, task_ended - task_started)
        bar.update(task.nbytes)

    finished: set[str] = set()
    try:
        if pool is None:
            context = make_context(*context_args)
            for task in todo:
                task_started = time.time()
                results = run_task(context, task)
                finish(task, results, task_started, time.time())
                finished.add(task.task_id)
        else:
            concurrency = min(concurrency, pool.workers)
            ready = 0.0
            for task, results, ready_at, task_started, task_ended in _run_bounded(pool, todo, concurrency):
                ready = max(ready, ready_at)
                finish(task, results, task_started, task_ended)
                finished.add(task.task_id)
            stats.startup_seconds = max(0.0, ready - pool.created_at)
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
        if own_pool:
            pool.__exit__(None, None, None)
    stats.seconds = time.time() - started
    stats.records = dict(manifest.done)
    if todo:
        logger.info("%s: %s", description, stats.summary(concurrency))
    return stats


def _run_bounded(pool: WorkerPool, todo: list[Task], limit: int) -> Iterator[tuple]:
    """``todo`` run in ``pool`` in order with at most ``limit`` in flight (the memory budget may allow fewer
    than the pool's workers); yields each result as it finishes, re-raising a task's failure."""
    from concurrent.futures import FIRST_COMPLETED, wait
    from concurrent.futures.process import BrokenProcessPool

    pending = iter(todo)
    running: dict = {}

    def broken(task_ids: list[str]) -> RuntimeError:
        running_what = " or ".join(task_ids) or "a task"
        return RuntimeError(f"a conversion worker stopped while running {running_what} (its error is printed above "
                            f"if it raised one; otherwise a signal or the OOM killer ended it); rerun the same "
                            f"command to resume")

    def submit() -> None:
        task = next(pending, None)
        if task is None:
            return
        try:
            running[pool.executor.submit(_run_in_worker, task)] = task
        except BrokenProcessPool as error:  # a worker died while this process was between results
            raise broken(sorted(t.task_id for t in running.values())) from error

    for _ in range(limit):
        submit()
    while running:
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in finished:
            task = running.pop(future)
            try:
                result = future.result()
            except BrokenProcessPool as error:
                raise broken([task.task_id]) from error
            yield result
            submit()
