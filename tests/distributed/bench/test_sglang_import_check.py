"""bench/sglang_import_check.py sees what only a GPU machine imports: a package that imports a module only when
torch has CUDA, and one that needs the GPU driver to load (stood in for)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CUDA_ONLY = '''import torch
if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
    from a_kernel_package_not_installed import fast_op
'''
NEEDS_DRIVER = '''from driver_bound_kernels.ops import fused_thing
from driver_bound_kernels import scalar_types
TYPES = [scalar_types.uint4b8]
class Layer(fused_thing.Base):
    pass
'''


def run_check(tmp_path, source: str, *extra: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    (site / "engine_like").mkdir(parents=True, exist_ok=True)
    (site / "engine_like" / "__init__.py").write_text(source)
    return subprocess.run([sys.executable, "bench/sglang_import_check.py", str(site), "--modules", "engine_like",
                           *extra], capture_output=True, text=True, timeout=120)


def test_a_cuda_only_import_is_found_on_a_machine_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the import is found anyway")
    result = run_check(tmp_path, CUDA_ONLY)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "MISSING a_kernel_package_not_installed while importing engine_like" in result.stdout


def test_a_driver_bound_package_is_stood_in_for_and_the_rest_imports(tmp_path):
    assert run_check(tmp_path, NEEDS_DRIVER, "--stand-in", "driver_bound_kernels").stdout.strip() == "OK"
    without = run_check(tmp_path, NEEDS_DRIVER, "--stand-in", "")
    assert without.returncode == 3 and "MISSING driver_bound_kernels" in without.stdout
