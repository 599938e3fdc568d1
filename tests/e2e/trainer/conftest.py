"""The runs of this directory run on the session's one Ray cluster (``ray_cluster``, tests/conftest.py).

Starting a cluster costs ~4-7 s on the 2-core CI machine and some thirty runs here use Ray; each attaches to
that one instead (``start_workers`` leaves a cluster it did not start running) and brings up its own worker
processes as before, so runs stay independent. What a run's workers need from the driver's environment
(threads, the fault-injection point) travels with each worker group, not with the cluster. Runs that must own
their cluster (a driver killed or signalled) run in subprocesses of their own.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def on_the_shared_ray_cluster(ray_cluster):
    yield
