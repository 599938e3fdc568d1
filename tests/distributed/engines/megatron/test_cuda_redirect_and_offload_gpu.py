"""`cpu_compat.cuda_tensors_on_cpu` (scoped CUDA->CPU redirection) and, on a GPU box, offload memory release."""

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(240)
def test_offload_releases_gpu_memory_and_reload_restores_it():
    from tests.dist_harness import run_distributed

    assert run_distributed(_gpu_worker, 1)[0]


def _gpu_worker(rank):
    import os

    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.offload import offload_engine, reload_engine
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(), seed=1)
    config = tiny_config()
    actor = ActorEngine(model_provider=gpt_provider(config), config=config,
                        optimizer_config=OptimizerConfig(lr=1e-3), micro_batch_size=2)
    batch = synthetic_batch()
    batch.old_log_probs, _ = actor.compute_log_probs(batch)
    actor.update_policy(batch, mini_batch_size=4)
    before = torch.cuda.memory_allocated()
    state = offload_engine(actor)
    after = torch.cuda.memory_allocated()
    reload_engine(state)
    actor.update_policy(batch, mini_batch_size=4)
    return after < before - state.num_bytes // 2
