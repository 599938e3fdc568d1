"""On CUDA: packed (thd) micro-batches through PyTorch's variable-length flash kernel give the padded
rows' log-probs, and a packed token-budget update trains.

One engine (a Qwen2-shaped model, head_dim 64, random weights, local spec with the SDPA core attention)
computes the log-probs of the same variable-length batch three ways by switching its micro-batching:
padded rows (SDPA with a boolean mask: the memory-efficient kernel), packed rows, packed rows grouped by a
token budget. bf16: the packed runs must call ``varlen_attn`` and agree with padded to bf16 accuracy;
fp32 (no flash kernel: one causal SDPA call per segment) to float accuracy. Skipped without CUDA (the CPU
equivalents are in tests/distributed/engines/megatron/test_packing.py).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HF_CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=1000, hidden_size=512,
                 intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 use_sliding_window=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def _batch(rows=8, prompt=64, response=192, seed=0):
    from megarl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt // 4, prompt + 1, (rows,), generator=g)
    response_lens = torch.randint(1, response + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response)[None] < response_lens[:, None]).long()
    batch = TrainBatch(prompt_ids=torch.randint(3, 1000, (rows, prompt), generator=g) * prompt_mask,
                       prompt_mask=prompt_mask, response_mask=response_mask,
                       response_ids=torch.randint(3, 1000, (rows, response), generator=g) * response_mask,
                       group_ids=[str(i // 4) for i in range(rows)])
    batch.advantages = torch.randn(rows, 1, generator=g).expand(rows, response).contiguous() * response_mask
    return batch


def _worker(rank, dtype_name):
    from megatron.core.optimizer import OptimizerConfig

    import megarl.models.sdpa_attention as sdpa_attention
    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge

    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, dtype_name)
    calls = []
    if sdpa_attention._VARLEN is not None:
        varlen, keywords = sdpa_attention._VARLEN

        def counting(*args, **kwargs):
            calls.append(1)
            return varlen(*args, **kwargs)

        sdpa_attention._VARLEN = (counting, keywords)
    initialize_megatron_parallel(layout=ParallelLayout(), seed=5)
    bridge = ModelBridge.from_hf_config(HF_CONFIG, spec="local")
    config = bridge.transformer_config(layout=ParallelLayout(), params_dtype=dtype)

    def provider(pre_process, post_process, vp_stage=None):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process)

    actor = ActorEngine(model_provider=provider, config=config, micro_batch_size=2,
                        optimizer_config=OptimizerConfig(lr=1e-5, clip_grad=1.0, bf16=dtype == torch.bfloat16,
                                                         params_dtype=dtype, use_distributed_optimizer=False))
    batch = _batch()
    out = {"mask": batch.response_mask.bool()}
    for name, micro_batching in (("padded", MicroBatching()), ("packed", MicroBatching(sequence_packing=True)),
                                 ("budget", MicroBatching(sequence_packing=True, max_tokens_per_micro_batch=600))):
        actor.micro_batching = micro_batching
        before = len(calls)
        out[name] = actor.compute_log_probs(batch)[0].cpu()
        out[f"{name}_varlen_calls"] = len(calls) - before
    batch.old_log_probs = out["padded"]
    out["update"] = actor.update_policy(batch)
    return out


def _in_each_dtype(rank, dtype_names):
    """Both dtypes in one rank's process: one process start instead of two (each run counts its own varlen
    calls: a second run's counting wrapper wraps the first's, which appends to the first run's list only)."""
    return {name: _worker(rank, name) for name in dtype_names}


@pytest.fixture(scope="module")
def outputs():
    from tests.dist_harness import run_distributed

    return run_distributed(_in_each_dtype, 1, ("bfloat16", "float32"), timeout_s=300, cuda=True)[0]


@pytest.mark.timeout(360)
def test_bf16_packed_log_probs_use_varlen_flash_and_match_padded(outputs):
    out = outputs["bfloat16"]
    mask = out["mask"]
    padded = out["padded"][mask].double()
    for name in ("packed", "budget"):
        err = float((out[name][mask].double() - padded).norm() / padded.norm())
        print(f"bf16 {name} vs padded: rel err {err:.2e}, varlen calls {out[f'{name}_varlen_calls']}")
        assert out[f"{name}_varlen_calls"] >= 4  # one per layer per micro-batch, no per-segment fallback
        assert err < 2e-2
    assert out["padded_varlen_calls"] == 0
    update = out["update"]
    assert update["grad_norm"] == update["grad_norm"] and update["grad_norm"] > 0  # finite, not NaN
    print("packed budget update:", update)


@pytest.mark.timeout(360)
def test_fp32_packed_log_probs_match_padded_tightly(outputs):
    out = outputs["float32"]
    mask = out["mask"]
    for name in ("packed", "budget"):
        torch.testing.assert_close(out[name][mask], out["padded"][mask], rtol=1e-4, atol=1e-4)
        assert out[f"{name}_varlen_calls"] == 0
