"""`cpu_compat.cuda_tensors_on_cpu` (scoped CUDA->CPU redirection); offload on a GPU is tests/gpu/test_offload_cuda.py."""

import pytest
import torch


def test_cuda_tensors_on_cpu_redirects_only_inside_the_context():
    from megarl.models import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the redirection is a no-op on CUDA machines")
    cpu_compat.enable_cpu_compat()
    with cpu_compat.cuda_tensors_on_cpu():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert torch.nn.Parameter(torch.ones(1)).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64  # type(dtype) untouched
    assert torch.ones(1).type() == "torch.FloatTensor"
