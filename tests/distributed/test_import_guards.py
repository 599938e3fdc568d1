"""megarl's processes import megatron-core without its optional wandb and tensorboard imports and without torch's compiler stack
(megarl/_import_guards.py); wandb still imports where megarl's trackers use it, and megatron's ``jit_fuser``
functions still run compiled, compiled once, at their first call. In a fresh interpreter, as a Ray worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO

WANDB_PROBE = """
import sys
import megarl
import megatron.core
from megatron.core import timers
from megatron.core.inference.contexts import dynamic_context
print("after megatron:", "wandb" in sys.modules, timers.wandb is None, dynamic_context.HAVE_WANDB,
      "torch.utils.tensorboard" in sys.modules)
import wandb
print("wandb imports:", wandb.__version__ == __import__("importlib.metadata").metadata.version("wandb"))
from torch.utils.tensorboard import SummaryWriter
print("tensorboard imports:", SummaryWriter.__name__)
"""

# A counting backend stands in for inductor (no C++ compiler needed): it counts the graphs dynamo hands it.
COMPILE_PROBE = """
import sys
import torch
import megarl
import megatron.core
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe import router
from megatron.core.fusions import fused_bias_swiglu
from megatron.core import jit
from megarl._import_guards import compile_on_first_call
print("compiler after megatron:", "torch._dynamo" in sys.modules, jit.jit_fuser is compile_on_first_call)
graphs = []
def counting(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
@compile_on_first_call(backend=counting)
def swiglu(x):
    a, b = torch.chunk(x, 2, -1)
    return torch.nn.functional.silu(a) * b
x = torch.randn(4, 8, dtype=torch.float64)
want = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
first, second = swiglu(x), swiglu(x)
print("compiled once:", len(graphs), torch.equal(first, want), torch.equal(second, want))
@torch.compile(backend=counting)
def outer(x):
    return swiglu(x) * 2
print("inlined:", torch.equal(outer(x), want * 2), len(graphs))
# inductor's kernel may round differently from eager's: equal to fp64's precision, relative to the values
got = fused_bias_swiglu.bias_swiglu_impl(x, None)
print("megatron's:", bool((got - want).abs().max() <= 1e-14 * want.abs().max()))
"""


def _run(probe: str) -> str:
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_megatron_comes_without_wandb_and_tensorboard_and_both_still_import():
    pytest.importorskip("wandb")
    out = _run(WANDB_PROBE)
    assert "after megatron: False True False False" in out, out
    assert "wandb imports: True" in out, out
    assert "tensorboard imports: SummaryWriter" in out, out


def test_megatron_comes_without_the_compiler_and_its_fused_functions_compile_once_when_called():
    out = _run(COMPILE_PROBE)
    assert "compiler after megatron: False True" in out, out
    assert "compiled once: 1 True True" in out, out  # the second call reuses the first call's compile
    assert "inlined: True 2" in out, out  # inside another compiled function: one graph for both, no second compile
    assert "megatron's: True" in out, out
