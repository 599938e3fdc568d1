"""Tests by cost. ``tests/unit``: pure functions, configs, data, planners, the import graph; no processes, no
Ray, seconds in all (``pytest tests/unit`` is the edit loop). Everything else starts processes: multi-rank
torch.distributed on gloo, Ray clusters, vLLM, real Slurm, whole training runs. Each test gets the marker of
its kind, so ``-m unit`` / ``-m "not unit"`` select them from anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        is_unit = UNIT_DIR in Path(str(item.fspath)).resolve().parents
        item.add_marker(pytest.mark.unit if is_unit else pytest.mark.integration)
