"""Shared pieces of the engine tests: a tiny GPT provider, fp32 engine configs and a fixed synthetic batch."""

from __future__ import annotations

import torch

VOCAB = 128
PROMPT_LEN = 6
RESPONSE_LEN = 6


# moe=True: every layer's MLP is 4 experts, 2 routed per token (megatron's local MoE layer, no balancing loss)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall",
           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False)


def tiny_config(*, tp: int = 1, pp: int = 1, vpp=None, num_layers: int = 2, moe: bool = False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**(MOE if moe else {}),
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        use_cpu_initialization=True, perform_initialization=True, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, gated_linear_unit=True, add_bias_linear=False,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, bf16=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32 if pp > 1 else None,
    )


def gpt_provider(config, *, seed: int = 11, tie: bool = False, sdpa: bool = False):
    """A model_provider re-seeding before each chunk. With use_cpu_initialization the TP shards are slices of
    the same master weights, so TP=1 and TP=2 hold identical models; PP stages re-seed per chunk and so do
    NOT match PP=1 (those tests load a checkpoint instead). ``sdpa``: megarl's SDPA core attention (needed
    for packed sequences) instead of megatron's local one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def provide(pre_process, post_process, vp_stage):
        torch.manual_seed(seed)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        if sdpa:
            from megarl.models.sdpa_attention import SDPADotProductAttention

            spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
            max_sequence_length=64, position_embedding_type="rope", pre_process=pre_process,
            post_process=post_process, share_embeddings_and_output_weights=tie, vp_stage=vp_stage,
        )

    return provide


def synthetic_batch(rows: int = 8, seed: int = 0, prompt_len: int = PROMPT_LEN, response_len: int = RESPONSE_LEN):
    from megarl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, VOCAB, (rows, prompt_len), generator=g)
    response_ids = torch.randint(1, VOCAB, (rows, response_len), generator=g)
    prompt_lens = torch.randint(2, prompt_len + 1, (rows,), generator=g)
    resp_lens = torch.randint(1, response_len + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt_len)[None] >= prompt_len - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_len)[None] < resp_lens[:, None]).long()
    prompt_ids = prompt_ids * prompt_mask
    response_ids = response_ids * response_mask
    batch = TrainBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=response_mask, group_ids=[str(i // 4) for i in range(rows)])
    batch.advantages = torch.randn(rows, 1, generator=g).expand(rows, response_len).clone() * response_mask
    batch.returns = torch.randn(rows, response_len, generator=g) * response_mask
    return batch
