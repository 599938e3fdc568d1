"""One local Ray cluster for the runs of this directory.

Starting a cluster costs ~4-7 s on the 2-core CI machine and some thirty runs here use Ray; each attaches to
this one instead (``start_workers`` leaves a cluster it did not start running) and brings up its own worker
processes as before, so runs stay independent. What a run's workers need from the driver's environment
(threads, the fault-injection point) travels with each worker group, not with the cluster. Runs that must own
their cluster (a driver killed or signalled) run in subprocesses of their own.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def shared_ray_cluster():
    ray = pytest.importorskip("ray")
    from megarl.controller.ray_cluster import init_ray, shutdown_ray
    from megarl.controller.worker_env import worker_env_for

    started = not ray.is_initialized()
    if started:
        init_ray(None, num_cpus=8, extra_env=worker_env_for("cpu"))
    yield
    if started:
        shutdown_ray()
