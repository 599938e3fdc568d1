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


@pytest.mark.timeout(240)
def test_offloaded_copies_take_their_own_size_of_host_memory_in_one_reused_buffer():
    """Tensors of just over a power of two each (33 MiB + 4 KiB): PyTorch's pinned allocator would round every copy
    up to 64 MiB and keep it; the engine's one registered buffer holds them at their own size, and its next
    offload reuses it."""
    from tests.dist_harness import run_distributed

    result = run_distributed(_host_size_worker, 1, cuda=True)[0]
    assert result["one_buffer"] and result["pinned"] and result["reused"] and result["restored"]
    exact = result["exact_bytes"]
    print(f"resident growth {result['rss_growth'] / 2**30:.2f} GiB for {exact / 2**30:.2f} GiB of copies")
    assert result["buffer_bytes"] < exact * 1.01
    assert result["rss_growth"] < exact * 1.2  # the rounded copies would take 1.94x


def _host_size_worker(rank):
    from types import SimpleNamespace

    from megarl.checkpoint_io.memory import current_rss_bytes
    from megarl.engines.megatron.offload import offload_engine, reload_engine

    size = (33 * 2**20 + 4096) // 2  # bf16 elements
    layers = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(40)).cuda()
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn(size, device="cuda", dtype=torch.bfloat16), requires_grad=False)
    engine = SimpleNamespace(model=[layers], optimizer=None)
    originals = [layer.weight.detach().clone() for layer in layers]
    torch.cuda.synchronize()
    rss_before = current_rss_bytes()
    state = offload_engine(engine, params=True, grads=False, optimizer=False)
    rss_growth = current_rss_bytes() - rss_before
    backups = [entry.backup for entry in state.entries]
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in backups}
    buffer_bytes = backups[0].untyped_storage().nbytes()
    first_buffer = next(iter(buffer_ptrs))
    reload_engine(state)
    again = offload_engine(engine, params=True, grads=False, optimizer=False)
    reused = {e.backup.untyped_storage().data_ptr() for e in again.entries} == {first_buffer}
    # offloading it again before the reload finds nothing on the device and leaves the buffer as it is
    reused &= offload_engine(engine, params=True, grads=False, optimizer=False).entries == []
    reused &= engine._offload_host_buffer.tensor.data_ptr() == first_buffer
    reload_engine(again)
    return {"one_buffer": len(buffer_ptrs) == 1, "pinned": all(b.is_pinned() for b in backups),
            "buffer_bytes": buffer_bytes, "exact_bytes": 40 * 2 * size, "rss_growth": rss_growth, "reused": reused,
            "restored": all(torch.equal(layer.weight, original) for layer, original in zip(layers, originals))}
