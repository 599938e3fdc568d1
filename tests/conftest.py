"""Tests by cost, one directory per tier, each test marked with its tier so ``-m`` selects them from anywhere:

* ``tests/unit`` (``unit``): pure functions, configs, data, planners, the import graph; no processes, no Ray,
  seconds in all (``pytest tests/unit`` is the edit loop);
* ``tests/distributed`` (``distributed``): components across real processes: multi-rank torch.distributed on
  gloo, Ray worker groups, vLLM, converters, engines; tens of seconds each at most;
* ``tests/e2e`` (``e2e``): whole training runs through the trainer (one Ray cluster shared by the directory),
  launches on real Slurm and hand-made Ray clusters;
* ``tests/gpu`` (``gpu``): CUDA only, skipped where there is none; every GPU test lives here, since
  ``pytest tests/gpu`` is what ``bench/run_device.sh validate`` runs on the lent GPU first thing in every stay.

Tests that run on a Ray cluster (the controller's worker groups and transports, the trainer's runs) share one,
``ray_cluster``: started by the first that asks, stopped at the end of the session. Tests about starting and
losing clusters (the launch tests, a SIGKILLed driver) start their own in processes of their own.

CI runs the suite in two pytest-xdist workers (``-n 2 --dist loadfile``: a file's tests stay in one worker, in
order, sharing its module fixtures): most of a run is waiting on processes starting, so two streams fill the
two cores. A test that needs the machine to itself (it measures the node's memory, say) is marked ``exclusive``:
it starts once the other worker's current test has ended, and the other worker starts nothing until it ends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
RAY_CPUS = 8  # logical CPUs of the shared cluster: the trainer's runs take up to 4 ranks of 1 CPU, twice over
TIERS = {"unit": pytest.mark.unit, "distributed": pytest.mark.distributed, "e2e": pytest.mark.e2e,
         "gpu": pytest.mark.gpu}


# The order files start in under xdist, longest first: a file is one unit of work (``--dist loadfile``), and
# the run ends when the worker that got the last long file ends it. xdist's own order (most tests first) put
# the single-test real-Slurm launch (the longest file, ~4 min) among the last, with the other worker idle
# beside it. The launch tests are the longest single tests, then whole training runs, then components; the
# unit tests, hundreds of short files, fill in at the end.
START_ORDER = ("e2e/launch", "e2e", "distributed", "gpu", "unit")


def _start_rank(path: Path) -> int:
    relative = path.relative_to(TESTS).as_posix()
    return next(rank for rank, prefix in enumerate(START_ORDER) if relative.startswith(prefix + "/"))


def pytest_collection_modifyitems(config, items):
    start_rank = {}
    for item in items:
        path = Path(str(item.fspath)).resolve()
        tier = path.relative_to(TESTS).parts[0] if TESTS in path.parents else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{path}: every test lives in one of tests/{{{','.join(TIERS)}}}/")
        if tier != "gpu" and item.get_closest_marker("gpu") is not None:
            # `pytest tests/gpu` is what runs on the lent GPU: a GPU test anywhere else would never run there
            raise pytest.UsageError(f"{item.nodeid}: a test marked gpu lives in tests/gpu/")
        item.add_marker(TIERS[tier])
        start_rank[item.nodeid] = _start_rank(path)
    items.sort(key=lambda item: start_rank[item.nodeid])  # stable: a file's order kept


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's one local Ray cluster. Its workers get the repository on PYTHONPATH (they import worker
    classes of test modules by reference), the CPU workers' thread settings, and ``MEGARL_TEST_MARKER`` (which
    shows that init_ray's environment reaches them)."""
    pytest.importorskip("ray")
    import torch

    from megarl.controller.ray_cluster import init_ray, shutdown_ray
    from megarl.controller.worker_env import worker_env_for
    from tests.paths import REPO

    init_ray(None, num_cpus=RAY_CPUS, num_gpus=torch.cuda.device_count(), extra_pythonpath=[str(REPO)],
             extra_env={**worker_env_for("cpu"), "MEGARL_TEST_MARKER": "on"})
    yield
    shutdown_ray()


LOCKS_DIR_ENV = "MEGARL_TEST_LOCKS"  # the xdist run's lock files' folder, made by the controller for its workers


def pytest_configure(config):
    """The controller of an xdist run (it has workers to start, and is not one) makes the folder of the run's lock
    files; its workers inherit the variable naming it, and the controller removes it once they have all ended.
    Files start in the order collected (``START_ORDER``), not in xdist's (most tests first)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[LOCKS_DIR_ENV] = config._megarl_locks_dir = tempfile.mkdtemp(prefix="megarl-test-locks-")


def pytest_unconfigure(config):
    locks_dir = getattr(config, "_megarl_locks_dir", None)
    if locks_dir:
        shutil.rmtree(locks_dir, ignore_errors=True)
        os.environ.pop(LOCKS_DIR_ENV, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Share the machine between xdist workers as a readers-writer lock over the whole protocol of an item (its
    fixtures' setup and teardown too: a module's engine starts inside its first test's protocol): every test
    holds ``room`` shared, an ``exclusive`` one holds it alone. ``turnstile`` gives the exclusive one priority:
    it holds the turnstile while it waits for the room, so the other worker's next test queues behind it rather
    than keeping the room shared forever. Without xdist (``pytest tests/unit``, a single file) this does nothing."""
    locks_dir = os.environ.get(LOCKS_DIR_ENV) if hasattr(item.config, "workerinput") else None
    if not locks_dir:
        yield
        return
    mode = fcntl.LOCK_EX if item.get_closest_marker("exclusive") else fcntl.LOCK_SH
    with open(f"{locks_dir}/turnstile", "a") as turnstile, open(f"{locks_dir}/room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, mode)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
