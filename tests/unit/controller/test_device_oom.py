"""Out of device memory in any of its forms becomes one error that names the phase, the rank, the numbers and
the knobs; other errors pass through untouched. (Through the worker groups: tests/distributed/controller/test_worker_group.py; on the GPU:
tests/gpu/test_device_oom_cuda.py.)"""

import pickle

import pytest
import torch

from megarl.controller.device_oom import PHASES, DeviceOutOfMemory, naming_out_of_memory, requested_bytes

TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.06 GiB is free.")
NCCL_OOM = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
            "NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
            "Failed to CUDA calloc async 608 bytes")


def test_torch_oom_names_phase_rank_request_and_the_update_knobs():
    with pytest.raises(DeviceOutOfMemory) as caught:
        with naming_out_of_memory("update_actor", rank=3):
            raise torch.OutOfMemoryError(TORCH_OOM)
    error = caught.value
    assert error.phase == "update_actor" and error.rank == 3
    assert error.requested_bytes == 2.5 * 2**30
    text = str(error)
    assert "out of device memory in actor update" in text and "rank 3" in text and "requested 2.50 GiB" in text
    assert "ppo_max_token_len_per_gpu" in text and "recompute_granularity" in text and "optimizer_cpu_offload" in text
    assert isinstance(error.__cause__, torch.OutOfMemoryError)


def test_nccl_calloc_failure_in_a_collective_is_out_of_memory_not_a_network_fault():
    with pytest.raises(DeviceOutOfMemory, match=r"out of device memory in weight sync .* rank 0: requested 608 bytes"):
        with naming_out_of_memory("sync_weights", rank=0):
            raise torch.distributed.DistBackendError(NCCL_OOM)


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_every_known_phase_names_at_least_one_knob_that_exists(phase):
    from megarl.config.schema import MegarlConfig

    description, knobs = PHASES[phase]
    assert description and knobs
    from megatron.core.optimizer import OptimizerConfig

    for knob in knobs:  # the dotted key before any '=' / ' ' must be a real config path
        path = knob.split("=")[0].split(" ")[0]
        for expanded in _expand_braces(path):
            node = MegarlConfig()
            for part in expanded.split("."):
                if isinstance(node, dict):  # override_optimizer_config: megatron's own field names
                    assert part in OptimizerConfig.__dataclass_fields__, f"{phase}: {expanded!r}"
                    break
                assert hasattr(node, part), f"{phase}: knob {expanded!r} is not a config key"
                node = getattr(node, part)


def _expand_braces(path: str) -> list[str]:
    if "{" not in path:
        return [path]
    head, rest = path.split("{", 1)
    options, tail = rest.split("}", 1)
    return [f"{head}{option}{tail}" for option in options.split(",")]


def test_other_errors_pass_through_and_the_error_survives_pickling():
    with pytest.raises(ValueError, match="bad row"):
        with naming_out_of_memory("generate", rank=0):
            raise ValueError("bad row")
    with pytest.raises(DeviceOutOfMemory) as caught:
        with naming_out_of_memory("generate", rank=1):
            raise RuntimeError("CUDA error: out of memory")
    copy = pickle.loads(pickle.dumps(caught.value))  # Ray ships it to the driver this way
    assert str(copy) == str(caught.value) and copy.phase == "generate" and copy.rank == 1
    with pytest.raises(DeviceOutOfMemory) as again:  # said once, not wrapped twice
        with naming_out_of_memory("update_actor", rank=1):
            raise caught.value
    assert again.value is caught.value
    assert requested_bytes("no numbers here") is None
