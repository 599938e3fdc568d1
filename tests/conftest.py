"""Tests by cost, one directory per tier, each test marked with its tier so ``-m`` selects them from anywhere:

* ``tests/unit`` (``unit``): pure functions, configs, data, planners, the import graph; no processes, no Ray,
  seconds in all (``pytest tests/unit`` is the edit loop);
* ``tests/distributed`` (``distributed``): components across real processes: multi-rank torch.distributed on
  gloo, Ray worker groups, vLLM, converters, engines; tens of seconds each at most;
* ``tests/e2e`` (``e2e``): whole training runs through the trainer (one Ray cluster shared by the directory),
  launches on real Slurm and hand-made Ray clusters;
* ``tests/gpu`` (``gpu``): CUDA only, skipped where there is none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = {"unit": pytest.mark.unit, "distributed": pytest.mark.distributed, "e2e": pytest.mark.e2e,
         "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        tier = path.relative_to(TESTS).parts[0] if TESTS in path.parents else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{path}: every test lives in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(TIERS[tier])
