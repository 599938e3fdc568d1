"""One local Ray cluster for the worker-group and transport tests of this directory.

4 logical CPUs (the worker groups take 0.5 CPU per rank), a small object store, and the repository on the
workers' PYTHONPATH: they import the worker classes of these test modules (``tests.distributed.controller.*``)
and bench/ by reference. ``MEGARL_TEST_MARKER`` shows that init_ray's environment reaches the workers.
"""

from __future__ import annotations

import pytest

from tests.paths import REPO


@pytest.fixture(scope="package")
def ray_cluster():
    from megarl.controller.ray_cluster import init_ray, shutdown_ray

    init_ray(num_cpus=4, extra_pythonpath=[str(REPO)], extra_env={"MEGARL_TEST_MARKER": "on"},
             object_store_memory=200 * 1024**2, log_to_driver=False)
    yield
    shutdown_ray()
