"""On a GPU: the actor with megatron's CPU-offloaded optimizer (``override_optimizer_config``:
optimizer_cpu_offload + use_precision_aware_optimizer, what 7B on one GPU needs) trains like the one with Adam on
the device, keeps Adam's state and the fp32 master weights on the host, and survives the hybrid engine's
offload/reload, which leaves that host state where it is and drops the grad buffer.

Both engines start from the same bf16 weights and take the same three steps; both keep fp32 masters, so they
differ only by the order of fp32 operations in two Adam implementations, far below one bf16 ulp of a weight:
the change of the log-probs must agree to 5% of its size."""

import pytest
import torch

from tests.dist_harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]

STEPS = 3


def _worker(rank):
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.offload import offload_engine, reload_engine
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(), seed=1)
    on_device = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                                use_distributed_optimizer=True)
    on_host = dataclasses.replace(on_device, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                  overlap_cpu_optimizer_d2h_h2d=True, use_precision_aware_optimizer=True)
    batch = synthetic_batch()

    def build(optimizer_config):
        config = dataclasses.replace(tiny_config(), bf16=True, params_dtype=torch.bfloat16)
        return ActorEngine(model_provider=gpt_provider(config), config=config, optimizer_config=optimizer_config,
                           ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                    use_distributed_optimizer=True),
                           micro_batch_size=4)

    results = {}
    for name, optimizer_config in (("device", on_device), ("host", on_host)):
        actor = build(optimizer_config)
        initial, _ = actor.compute_log_probs(batch)
        batch.old_log_probs = initial
        torch.cuda.synchronize()
        allocated_before = torch.cuda.memory_allocated()
        for step in range(STEPS):
            if name == "host" and step == 1:  # the hybrid engine's turn between two steps
                state = offload_engine(actor)
                results["offload_host_bytes"], results["offload_device_bytes"] = state.host_bytes, state.num_bytes
                reload_engine(state)
            metrics = actor.update_policy(batch, mini_batch_size=8)
        torch.cuda.synchronize()
        final, _ = actor.compute_log_probs(batch)
        # megatron's DistributedOptimizer (one per chain link) wraps the torch optimizer
        (wrapper,) = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
        inner = wrapper.optimizer
        # Adam's moments and masters (its step count is a host scalar either way)
        states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        results[name] = {"initial": initial.cpu(), "final": final.cpu(), "metrics": metrics,
                         "state_devices": sorted({t.device.type for t in states}),
                         "state_bytes": sum(t.numel() * t.element_size() for t in states),
                         "optimizer": type(inner).__name__,
                         "device_growth": torch.cuda.memory_allocated() - allocated_before}
        del actor
        torch.cuda.empty_cache()
    return results


def test_cpu_offloaded_optimizer_trains_like_the_device_one_and_keeps_its_state_on_the_host():
    r = run_distributed(_worker, 1, cuda=True)[0]
    device, host = r["device"], r["host"]
    print({k: {kk: vv for kk, vv in v.items() if kk not in ("initial", "final")} if isinstance(v, dict) else v
           for k, v in r.items()})
    assert host["optimizer"] == "HybridDeviceOptimizer" and host["state_devices"] == ["cpu"]
    assert device["state_devices"] == ["cuda"]
    assert torch.equal(device["initial"], host["initial"])  # the same starting weights
    change_device = device["final"] - device["initial"]
    change_host = host["final"] - host["initial"]
    scale = change_device.abs().max()
    assert scale > 1e-2, "the updates changed nothing: the comparison would prove nothing"
    assert (change_host - change_device).abs().max() <= 0.05 * scale
    # Adam's moments and the fp32 masters grow the device by their size with the device optimizer, not the host one
    assert device["device_growth"] - host["device_growth"] >= 0.9 * host["state_bytes"] * 2 / 3
    # offload between steps saved no host copy of the host-resident state (only the bf16 params: 2 B/param)
    assert r["offload_host_bytes"] < host["state_bytes"] / 4
