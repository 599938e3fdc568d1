"""The CPU-compatibility redirections: what they patch, and that real megatron runs with them."""

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.numerics import FP32_REORDERED, assert_close_to_scale


def _tiny_gpt_logits(rank: int, tp: int, seed: int):
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megarl.models.cpu_compat import applied_patches
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel

    info = initialize_megatron_parallel(layout=ParallelLayout(tensor_parallel=tp), seed=seed)
    assert applied_patches(), "gloo on a CPU machine must enable the compatibility layer"
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        use_cpu_initialization=True, perform_initialization=True, init_method_std=0.02,
        tensor_model_parallel_size=tp, gated_linear_unit=True, add_bias_linear=False,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, bf16=False, params_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=96,
        max_sequence_length=32, position_embedding_type="rope",
    )
    tokens = torch.arange(16).remainder(96).view(2, 8)
    positions = torch.arange(8).expand(2, 8)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask)
    logits.float().sum().backward()
    grad_norm_sq = torch.tensor(sum(float(p.grad.float().pow(2).sum()) for p in model.parameters()))
    full = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(full, logits.detach().contiguous(), group=None if tp == dist.get_world_size() else None)
    return info.tp_rank, torch.cat(full, dim=-1), grad_norm_sq


@pytest.mark.timeout(240)
def test_tp2_gpt_forward_backward_matches_tp1_on_gloo():
    (_, ref_logits, _), = run_distributed(_tiny_gpt_logits, 1, 1, 7)
    results = run_distributed(_tiny_gpt_logits, 2, 2, 7)
    for tp_rank, logits, grad_norm_sq in results:
        # use_cpu_initialization builds the full master weight from one seed and splits it, so TP=2
        # holds exactly the TP=1 weights and must give the same logits.
        assert_close_to_scale(logits, ref_logits, FP32_REORDERED, "logits")
        assert torch.isfinite(grad_norm_sq) and grad_norm_sq > 0


def test_cpu_rng_tracker_forks_per_name_and_restores_outer_state():
    from megarl.models.cpu_compat import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first_a = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(0)
    expected_after = torch.rand(3)
    torch.testing.assert_close(after, expected_after)  # the default stream was not advanced by the fork
    torch.manual_seed(1)
    torch.testing.assert_close(first_a, torch.rand(3))
    with tracker.fork("a"):
        second_a = torch.rand(3)
    assert not torch.equal(first_a, second_a)  # a named stream continues where it stopped
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("c", 1)
    with pytest.raises(RuntimeError, match="not added"):
        with tracker.fork("missing"):
            pass


def _moe_all_to_all_forward_beside_vllm(rank: int, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.cpu_compat import enable_cpu_compat

    enable_cpu_compat()  # an earlier engine of this process
    # then what an in-process vLLM CPU engine imports (a trainer.backend=inprocess run, vLLM's engine tests): it
    # puts placeholders in torch.cuda whose record_event returns None
    import vllm.v1.worker.cpu.shm  # noqa: F401

    initialize_megatron_parallel(layout=ParallelLayout(), seed=seed)  # this engine starting
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        use_cpu_initialization=True, add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, bf16=False, params_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                     vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
    tokens = torch.arange(16).view(2, 8)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    logits = model(input_ids=tokens, position_ids=torch.arange(8).expand(2, 8), attention_mask=mask)
    return tuple(logits.shape), bool(torch.isfinite(logits).all())


@pytest.mark.timeout(240)
def test_moe_dispatch_runs_in_a_process_that_also_imported_vllms_cpu_worker():
    pytest.importorskip("vllm")
    (shape, finite), = run_distributed(_moe_all_to_all_forward_beside_vllm, 1, 3)
    assert shape == (2, 8, 64) and finite
