"""Run a function in N real processes joined by a gloo process group (for multi-rank CPU tests).

``run_distributed(fn, world_size, *args)`` starts the ranks as fresh processes that know nothing of pytest,
sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, calls ``fn(rank, *args)`` in each and returns the per-rank
return values (which must be picklable). A failure on any rank is re-raised in the test with that rank's
traceback; a rank that hangs is killed after ``timeout_s``.

The ranks are forked from one fork server per test session (``forkserver`` start method), a clean interpreter
that has imported torch, megatron-core and transformers once: a spawned interpreter takes 4-5 s to import them
on a 2-core machine, and the suite starts ranks over a hundred times. Nothing runs in the server beyond those
imports (no thread pool, no process group), and it runs with every GPU hidden, so nothing it imports can
initialise CUDA: a process forked after CUDA's initialisation cannot use CUDA at all.

GPU ranks (``cuda=True``) are spawned instead, from fresh interpreters that see the GPUs: CUDA may not be
initialised before a fork, and the import cost is small next to a GPU test. Rank r drives ``cuda:r``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import random
import socket
import time
import traceback
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Rank 0 binds the rendezvous port some time after it is chosen. A port from the system's ephemeral range
# (32768-60999 on Linux) can be handed to any process's outgoing or port-0 socket in between (a Ray worker of
# the session's cluster took one once), and Ray's workers listen on 10002-19999; this range is neither.
RENDEZVOUS_PORTS = range(20000, 32768)


def rendezvous_port() -> int:
    while True:
        port = random.choice(RENDEZVOUS_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _entry(fn, rank, world_size, port, args, queue, cuda):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)  # torch was imported before this environment was set (the fork server preloads it)
    try:
        if cuda:
            if torch.cuda._is_in_bad_fork():  # the one way a GPU rank is certain to fail: say why
                raise RuntimeError("this GPU rank was forked from a process that had initialised CUDA; "
                                   "GPU ranks must be spawned (tests/dist_harness.py)")
            torch.cuda.set_device(rank)
        result = fn(rank, *args)
        # Tensors put on a multiprocessing queue travel as shared-memory handles that die with this
        # process; serialise them to plain bytes instead.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including SystemExit from inside megatron
        queue.put((rank, False, traceback.format_exc()))


# imported once by the fork server; a module missing here is simply not preloaded (the fork server skips it)
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
           "megarl.models.bridge", "megarl.models.cpu_compat", "megarl.engines.megatron.actor"]


def _context(cuda: bool):
    if cuda:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _start(procs, cuda: bool) -> None:
    if cuda:
        for proc in procs:
            proc.start()
        return
    # The fork server starts with the first rank and inherits this environment: it must see no GPU, so that
    # no preloaded import can initialise CUDA in it (its children could then never use CUDA).
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 300.0,
                    cuda: bool = False) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks: CPU ranks (GPUs hidden) forked from the fork server,
    or with ``cuda=True`` spawned ranks that each drive their own GPU."""
    if cuda and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} GPU ranks asked for, {torch.cuda.device_count()} GPUs visible")
    ctx = _context(cuda)
    queue = ctx.Queue()
    port = rendezvous_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, cuda))
             for r in range(world_size)]
    _start(procs, cuda)
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                crashed = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if crashed:
                    codes = {r: procs[r].exitcode for r in crashed}
                    failures.append(f"ranks died without reporting (rank: exit code): {codes}")
                elif time.monotonic() > deadline:
                    failures.append(f"timed out after {timeout_s}s; ranks still running: "
                                    f"{[r for r in range(world_size) if r not in results]}")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"--- rank {rank} failed ---\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
