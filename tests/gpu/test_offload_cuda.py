"""On a GPU: offloading an engine releases its device memory and reloading it restores a working engine."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(240)
def test_offload_releases_gpu_memory_and_reload_restores_it():
    from tests.dist_harness import run_distributed

    assert run_distributed(_gpu_worker, 1, cuda=True)[0]


def _gpu_worker(rank):
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
