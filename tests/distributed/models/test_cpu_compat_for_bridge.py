"""The CPU redirections the bridge needed (pipeline schedules, MoE dispatch, MLA without TE).

End to end they are exercised by test_bridge_logits.py (PP schedules, EP all-to-all, MLA); here the
pieces are checked directly, without enabling the global patches in the pytest process.
"""

import torch

from megarl.models import cpu_compat


def test_new_patches_are_registered():
    names = [name for name, _ in cpu_compat._PATCHES]
    for expected in ("megatron.pipeline_schedules.cuda_tensors->cpu", "torch.Tensor.cuda->identity",
                     "torch.cuda.streams->synchronous_cpu", "megatron.moe_utils.missing_te_kernels->None",
                     "megatron.multi_latent_attention.HAVE_TE->False_without_te",
                     "megatron.moe.all_to_all_splits->host_numpy"):
        assert expected in names


def test_schedule_torch_proxy_sends_cuda_factories_to_cpu():
    proxy = cpu_compat._CpuDeviceTorch()
    counter = proxy.zeros([], dtype=torch.int, device="cuda")
    assert counter.device.type == "cpu" and counter.dtype == torch.int and counter.item() == 0
    assert proxy.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert proxy.float32 is torch.float32 and proxy.cat is torch.cat  # everything else is plain torch


def test_cpu_stream_and_event_are_synchronous_noops():
    stream = cpu_compat.CpuStream(device="cuda")
    other = cpu_compat.CpuStream()
    stream.wait_stream(other)
    event = stream.record_event()
    assert isinstance(event, cpu_compat.CpuEvent) and event.query()
    event.synchronize()
