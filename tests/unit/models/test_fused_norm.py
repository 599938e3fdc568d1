"""FusedRMSNorm: the formula of PyTorch's RMSNorm, its compiled twin (what CUDA runs), and the swap in a model."""

import pytest
import torch

from megarl.models import compiled
from megarl.models.fused_norm import FusedRMSNorm, fuse_rms_norms, rms_norm


def _reference(x, weight, eps):  # fp64 statistics: what every implementation approximates
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double() * weight.double()


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])  # the last: megatron's mix
def test_the_formula_is_pytorchs_rms_norm(dtype, weight_dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 2, 96, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(weight_dtype)
    got = rms_norm(x, weight, 1e-6)
    want = torch.nn.functional.rms_norm(x, (96,), weight, 1e-6)
    assert got.dtype == want.dtype == dtype
    # the same rounding steps: fp32 statistics, one cast, one multiply in the input's dtype
    scale = want.double().abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale
    assert (got.double() - _reference(x, weight, 1e-6)).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale


def test_a_model_keeps_its_parameters_and_outputs_when_its_norms_are_fused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8, eps=1e-6),
                                torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.LayerNorm(8)))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 8)
    before, keys = model(x), list(model.state_dict())
    weight = model[1].weight
    assert fuse_rms_norms(model) == 2
    assert isinstance(model[1], FusedRMSNorm) and model[1].weight is weight and model[1].eps == 1e-6
    assert model[2][1].__class__ is torch.nn.LayerNorm  # only RMSNorms are swapped
    assert model[2][0].eps is None  # resolved per input dtype at each call, as PyTorch's RMSNorm does
    assert list(model.state_dict()) == keys
    assert torch.equal(model(x), before)  # off CUDA the fused module calls PyTorch's own rms_norm


def test_a_failing_compile_warns_and_runs_the_eager_formula(monkeypatch):
    monkeypatch.setattr(compiled, "_twins", {})
    monkeypatch.setattr(compiled, "_failed", set())
    monkeypatch.setattr(compiled, "compile_wanted", lambda device: True)  # as on CUDA

    def broken(*args):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    norm = FusedRMSNorm(torch.nn.Parameter(torch.ones(4)), 1e-6)
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="inductor exploded"):
        out = norm(x)
    torch.testing.assert_close(out, rms_norm(x, norm.weight, 1e-6))
    assert rms_norm in compiled._failed
