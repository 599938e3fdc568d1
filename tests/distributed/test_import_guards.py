"""megarl's processes import megatron-core without its optional wandb import (megarl/_import_guards.py), and wandb
still imports where megarl's trackers use it. In a fresh interpreter, as a Ray worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO

pytest.importorskip("wandb")

PROBE = """
import sys
import megarl
import megatron.core
from megatron.core import timers
from megatron.core.inference.contexts import dynamic_context
print("after megatron:", "wandb" in sys.modules, timers.wandb is None, dynamic_context.HAVE_WANDB)
import wandb
print("wandb imports:", wandb.__version__ == __import__("importlib.metadata").metadata.version("wandb"))
"""


def test_megatron_comes_without_wandb_and_wandb_still_imports():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "after megatron: False True False" in result.stdout, result.stdout
    assert "wandb imports: True" in result.stdout, result.stdout
